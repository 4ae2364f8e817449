"""Pure decisions: admission, routing, speculation depth, device profiles. No I/O here."""

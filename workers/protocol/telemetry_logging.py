"""Structured logs: one JSON object per line with the current span's trace_id/span_id, secrets redacted.

`setup_logging(config.telemetry)` installs one handler on the root logger (idempotent: calling it again
replaces Pulse's handler, not anyone else's). Extra fields passed as ``log.info("msg", extra={...})``
become top-level JSON keys.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import re
import sys
from typing import IO, TYPE_CHECKING, Any

from opentelemetry import trace

if TYPE_CHECKING:
    from policy.config import TelemetryConfig

# API keys must never reach a log line: bearer tokens, OpenAI-style sk- keys, and the value of any
# Authorization / api-key field however it was printed (header dump, dict repr, JSON).
_SECRET_PATTERNS = (
    (re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/=\-]+"), "Bearer [REDACTED]"),
    (re.compile(r"\bsk-[A-Za-z0-9_\-]{4,}"), "sk-[REDACTED]"),
    (
        re.compile(r"(?i)((?:authorization|x-api-key|api[_-]key)[\"']?\s*[:=]\s*[\"']?)(?!Bearer \[REDACTED\])[^\s\"',}]+"),
        r"\1[REDACTED]",
    ),
)

# Attributes every LogRecord has; anything else on a record came from `extra=` and is logged as a field.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def redact(text: str) -> str:
    """Text with bearer tokens, sk- keys and Authorization/api-key values replaced by [REDACTED]."""
    for pattern, replacement in _SECRET_PATTERNS:
        text = pattern.sub(replacement, text)
    return text


class RedactFilter(logging.Filter):
    """Redacts secrets in the message, its arguments and string extras, before any formatter sees them."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact(message)
        if cleaned != message or record.args:
            record.msg, record.args = cleaned, None
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS and isinstance(value, str):
                setattr(record, key, redact(value))
        return True


def _span_ids() -> tuple[str | None, str | None]:
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None, None
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, trace_id, span_id, static fields, extras, exc."""

    def __init__(self, static: dict[str, Any] | None = None):
        super().__init__()
        self.static = dict(static or {})

    def format(self, record: logging.LogRecord) -> str:
        trace_id, span_id = _span_ids()
        line: dict[str, Any] = {
            "ts": dt.datetime.fromtimestamp(record.created, dt.timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            # An explicit trace_id in `extra=` (a line logged for another request) wins over the context.
            "trace_id": getattr(record, "trace_id", None) or trace_id,
            "span_id": getattr(record, "span_id", None) or span_id,
            **self.static,
        }
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS and key not in line:
                line[key] = value
        if record.exc_info:
            line["exc"] = redact(self.formatException(record.exc_info))
        if record.stack_info:
            line["stack"] = redact(self.formatStack(record.stack_info))
        return json.dumps(line, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """Human-readable lines that still carry the trace id: `... [trace=<id> span=<id>] message`."""

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s [trace=%(trace_id)s span=%(span_id)s] %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        trace_id, span_id = _span_ids()
        record.trace_id = getattr(record, "trace_id", None) or trace_id or "-"
        record.span_id = getattr(record, "span_id", None) or span_id or "-"
        return redact(super().format(record))


def setup_logging(
    config: TelemetryConfig | None = None,
    role: str | None = None,
    *,
    stream: IO[str] | None = None,
    logger: logging.Logger | None = None,
) -> logging.Handler:
    """Install Pulse's handler (JSON or text per config.log_format, with RedactFilter) on `logger` (root).

    Returns the handler. Call once per process, after `setup_tracing` (ids come from the live context).
    """
    target = logger if logger is not None else logging.getLogger()
    for old in [h for h in target.handlers if getattr(h, "_pulse", False)]:
        target.removeHandler(old)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler._pulse = True  # type: ignore[attr-defined]  # marks the handler a later call replaces
    fmt = config.log_format if config is not None else "json"
    handler.setFormatter(JsonFormatter({"role": role} if role else None) if fmt == "json" else TextFormatter())
    handler.addFilter(RedactFilter())
    target.addHandler(handler)
    target.setLevel((config.log_level if config is not None else "INFO").upper())
    return handler

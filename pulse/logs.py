"""Process logging for `pulse` commands; the telemetry module adds trace ids and JSON lines when present."""
from __future__ import annotations

import logging

from policy.config import PulseConfig


def setup_logging(config: PulseConfig) -> None:
    try:
        from workers.protocol.telemetry import setup_logging as telemetry_logging
    except ImportError:
        logging.basicConfig(level=config.telemetry.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return
    telemetry_logging(config.telemetry)

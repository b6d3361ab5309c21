"""Logging set-up shared by the services: one line per record, tagged with the service name."""

from __future__ import annotations

import logging
import sys

LOG_LEVELS = ("debug", "info", "warning", "error")


def configure_logging(level: str, service: str) -> None:
    """Route all loggers to stderr with the service name in every line."""
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )

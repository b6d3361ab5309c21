"""Logging set-up shared by the services: one line per record, tagged with the service name, as
text (the default) or as one JSON object per line (`--log-format json`, for log pipelines)."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

from splitserve_runtime.flags import flag, take_flag_notices

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")


LOGGING_FLAGS = (
    flag("--log-level", default="info", choices=LOG_LEVELS),
    flag(
        "--log-format",
        default="text",
        choices=LOG_FORMATS,
        help="text: one readable line per record; json: one JSON object per line with time, "
        "level, service, logger and message",
    ),
)
"""--log-level and --log-format (every service and the launcher)."""


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, service, logger, message, and
    exception when the record carries one."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(level: str, service: str, log_format: str = "text") -> None:
    """Route all loggers to stderr with the service name in every line."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(
            logging.Formatter(
                f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
            )
        )
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    for notice in take_flag_notices():  # vLLM flags that change nothing here: once each
        logging.getLogger("splitserve.flags").warning("%s", notice)


def is_text_logging() -> bool:
    """Whether the root logger writes text (progress bars would corrupt JSON lines)."""
    return not any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)

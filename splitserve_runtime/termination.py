"""A service's fatal error, as one line its parent can show (Kubernetes' termination message).

`splitserve up` gives each child a file through `$SPLITSERVE_TERMINATION_MESSAGE_PATH`; a service
that stops on a fatal error writes its one-line reason there, and the launcher prints it when the
child exits, instead of leaving the operator to find it among every service's log lines.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path

logger = logging.getLogger(__name__)

TERMINATION_MESSAGE_ENV = "SPLITSERVE_TERMINATION_MESSAGE_PATH"


def one_line(message: str) -> str:
    """The first line of `message` (the reason), stripped."""
    text = message.strip()
    return text.splitlines()[0] if text else ""


def report_fatal(service: str, message: str, environ: Mapping[str, str] | None = None) -> None:
    """Log the fatal reason and write it to the termination-message file, if one is set."""
    logger.error("%s: fatal: %s", service, message)
    env = os.environ if environ is None else environ
    path = env.get(TERMINATION_MESSAGE_ENV)
    if path:
        with contextlib.suppress(OSError):
            Path(path).write_text(one_line(message) + "\n")


def read_termination_message(path: Path) -> str:
    """What a child wrote before it stopped ("" when nothing)."""
    try:
        return one_line(path.read_text())
    except OSError:
        return ""

"""A service process's last step: leave without the interpreter's finalization.

After a service shut down in order (its ports closed, requests drained or aborted, spans
flushed, the model released), Python's own exit still tears down every imported module and runs
a full garbage collection over their objects: 1-3 s for a rank or a frontend (torch,
transformers, tokenizers), during which its pod is still terminating and a supervisor or test
waits for the exit code. Nothing in that teardown is the service's own work, so a service that
returned from main() flushes its log handlers and standard streams and ends with os._exit.
A service that fails (main() raises) still exits the normal way, traceback and all.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Flush the logs and standard streams, then end the process with `code`."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)

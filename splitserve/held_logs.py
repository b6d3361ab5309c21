"""The services' log lines, held back while `splitserve up` streams its sample answer.

The children inherit the launcher's stderr, so on a terminal their log lines land wherever the
streamed answer has got to ("...is Paris19:03:49 core INFO ..."). With HeldLogs the launcher's
file descriptor 2 becomes a pipe before any child starts: every child (a restarted one too, and
the launcher's own logging) writes its lines into it, and a relay thread copies them to the real
stderr as they come, except inside `held()`: then they are kept, in order, and written out when
the hold ends, after the answer's line. A log line is one write, which a pipe keeps whole (up
to PIPE_BUF bytes) however many processes share it. Nothing is dropped: past MAX_HELD_BYTES
the hold ends early and the lines flow again.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator

MAX_HELD_BYTES = 4 << 20
READ_BYTES = 1 << 16
CLOSE_WAIT_SECONDS = 2.0
"""How long `close` waits for the last lines (a grandchild may keep the pipe open)."""


class HeldLogs:
    """Owns file descriptor 2 from construction until `close`; see the module docstring."""

    def __init__(self) -> None:
        sys.stderr.flush()
        self._out = os.dup(2)
        """The real stderr."""
        self._read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)
        self._lock = threading.Lock()
        self._held: list[bytes] | None = None
        self._num_held = 0
        self._thread = threading.Thread(target=self._relay, name="log-relay", daemon=True)
        self._thread.start()

    def _relay(self) -> None:
        while chunk := os.read(self._read, READ_BYTES):
            with self._lock:
                if self._held is not None and self._num_held + len(chunk) <= MAX_HELD_BYTES:
                    self._held.append(chunk)
                    self._num_held += len(chunk)
                else:
                    self._release()
                    _write_all(self._out, chunk)

    def _release(self) -> None:
        """Write out what is held and stop holding (with the lock)."""
        for chunk in self._held or ():
            _write_all(self._out, chunk)
        self._held, self._num_held = None, 0

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Keep the log lines written meanwhile; write them out afterwards."""
        with self._lock:
            self._held = []
        try:
            yield
        finally:
            sys.stdout.flush()  # what was held comes after what was shown meanwhile
            sys.stderr.flush()
            with self._lock:
                self._release()

    def close(self) -> None:
        """Give file descriptor 2 back, once the children are stopped, after the lines still in
        the pipe."""
        sys.stderr.flush()
        os.dup2(self._out, 2)  # closes the launcher's end: the relay reads to the end
        self._thread.join(CLOSE_WAIT_SECONDS)
        with self._lock:
            self._release()
        if not self._thread.is_alive():  # else a grandchild holds the pipe: the relay goes on
            os.close(self._read)
            os.close(self._out)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except OSError:  # stderr is gone (a closed terminal): the lines cannot be shown
            return

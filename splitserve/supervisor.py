"""Supervisor: keep a running stack's children running, as a kubelet keeps a pod's containers.

Once the stack is ready, a child that exits (a worker rank killed, a wedged rank exiting to
restart clean, an engine core that crashed or failed) is started again at once with the same
command line: the same port and flags, so the engine core finds a restarted rank where it was
and a frontend finds a restarted core at the same address, and both resume their requests
(docs/reliability.md, Recovery). A child is down for good when it exits again before it is ready
(e.g. a core whose bring-up fails) or exits more than `max_restarts` times within
`window_seconds`: then the supervisor raises LaunchError and the launcher stops everything.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from splitserve.children import Child, LaunchError, is_ready

logger = logging.getLogger(__name__)
MAX_RESTARTS = 5
RESTART_WINDOW_SECONDS = 600.0


class Supervisor:
    """Restarts the children of a ready stack; call `poll` regularly (or `start` a thread)."""

    def __init__(
        self,
        children: Sequence[Child],
        max_restarts: int = MAX_RESTARTS,
        window_seconds: float = RESTART_WINDOW_SECONDS,
        report: Callable[[str], None] = logger.warning,
    ) -> None:
        self.children = children
        self.max_restarts = max_restarts
        self.window_seconds = window_seconds
        self._report = report
        self._restarts: dict[str, deque[float]] = {c.name: deque() for c in children}
        self._starting: set[str] = set()
        """Children restarted and not ready yet."""
        self.num_restarts = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failure: LaunchError | None = None

    def poll(self) -> None:
        """Restart children that exited; raise LaunchError for one that is down for good."""
        for child in self.children:
            code = child.process.poll()
            if code is None:
                if child.name in self._starting and is_ready(child):
                    self._starting.discard(child.name)
                    self._report(f"{child.name} is ready again")
                continue
            self._restart(child, code)

    def _restart(self, child: Child, code: int) -> None:
        reason = child.exit_reason(code)
        now = time.monotonic()
        restarts = self._restarts[child.name]
        while restarts and now - restarts[0] > self.window_seconds:
            restarts.popleft()
        if child.name in self._starting:
            raise LaunchError(f"{reason} (again, before it was ready)")
        if len(restarts) >= self.max_restarts:
            raise LaunchError(
                f"{reason} ({len(restarts)} restarts in the last {self.window_seconds:.0f} s)"
            )
        restarts.append(now)
        self._starting.add(child.name)
        self.num_restarts += 1
        self._report(f"{reason}; restarting it (same port and flags)")
        child.termination_message.write_text("")
        child.process = subprocess.Popen(child.command, env=child.env)

    def start(self, interval: float = 0.1) -> Supervisor:
        """Poll on a thread of its own until `stop` (a LaunchError ends it, in `failure`)."""
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()
        return self

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.poll()
            except LaunchError as err:
                self.failure = err
                self._report(str(err))
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10.0)

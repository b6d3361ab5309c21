"""StallWatch: a rank whose step runs far longer than its steps do is wedged (a peer rank died
inside a collective, or was stopped): its readiness turns NOT_SERVING until the step ends, so a
probe or an operator sees it, whatever the engine core does about it."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

logger = logging.getLogger(__name__)


class StallWatch:
    """Times steps; a watcher thread flags the current one once it passes the stall limit:
    `multiple` times the slowest recent step, and never less than `floor_seconds`."""

    def __init__(
        self, set_ready: Callable[[bool], None], floor_seconds: float = 10.0, multiple: float = 20.0
    ) -> None:
        self._set_ready = set_ready
        self.floor_seconds = floor_seconds
        self.multiple = multiple
        self._recent: deque[float] = deque(maxlen=100)
        self._started: float | None = None
        self.is_stalled = False
        self._stop = threading.Event()
        threading.Thread(target=self._watch, name="stall-watch", daemon=True).start()

    @property
    def limit_seconds(self) -> float:
        return max(self.floor_seconds, self.multiple * max(self._recent, default=0.0))

    def step_started(self) -> None:
        self._started = time.monotonic()

    def step_ended(self) -> None:
        started, self._started = self._started, None
        if started is not None:
            self._recent.append(time.monotonic() - started)
        if self.is_stalled:
            self.is_stalled = False
            logger.warning("the stalled step ended; ready again")
            self._set_ready(True)

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            started = self._started
            if started is None or self.is_stalled:
                continue
            elapsed = time.monotonic() - started
            if elapsed > self.limit_seconds:
                self.is_stalled = True
                logger.error("a step has run %.0f s (limit %.0f s): not ready", elapsed,
                             self.limit_seconds)  # fmt: skip
                self._set_ready(False)

    def close(self) -> None:
        self._stop.set()

"""How long a step may take before the rank running it counts as hung: the step watchdog's
timeout.

A step's cost depends on its size, so the timeout is learnt from the steps the engine ran: per
size bucket (powers of two of the scheduled tokens), a multiple of the recent p99 time, never
below a floor of a few seconds. A size never seen yet borrows the slowest per-token time seen at
any size; before the first steps, the generous first-step allowance applies (loading caches,
first-use costs). A SIGSTOPped or wedged rank is then noticed in seconds, not minutes.
"""

from __future__ import annotations

from collections import deque

WINDOW = 200
"""Recent step times kept per size bucket."""


class StepTimeout:
    """Learns step times; `seconds(num_tokens)` says how long the next step may take."""

    def __init__(self, floor_seconds: float, multiple: float, first_step_seconds: float) -> None:
        self.floor_seconds = floor_seconds
        self.multiple = multiple
        self.first_step_seconds = first_step_seconds
        self._times: dict[int, deque[float]] = {}
        self._max_seconds_per_token = 0.0

    @property
    def has_observed(self) -> bool:
        """Whether any step finished yet."""
        return bool(self._times)

    @staticmethod
    def _bucket(num_tokens: int) -> int:
        return max(num_tokens, 1).bit_length()

    def observe(self, num_tokens: int, seconds: float) -> None:
        times = self._times.setdefault(self._bucket(num_tokens), deque(maxlen=WINDOW))
        times.append(seconds)
        self._max_seconds_per_token = max(self._max_seconds_per_token, seconds / max(num_tokens, 1))

    def seconds(self, num_tokens: int) -> float:
        times = self._times.get(self._bucket(num_tokens))
        if times:
            ordered = sorted(times)
            expected = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
        elif self._max_seconds_per_token:
            expected = self._max_seconds_per_token * max(num_tokens, 1)
        else:
            return max(self.first_step_seconds, self.floor_seconds)
        return max(self.floor_seconds, self.multiple * expected)

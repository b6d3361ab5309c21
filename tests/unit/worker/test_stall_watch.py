"""StallWatch: a rank whose step runs past its limit reports NOT_SERVING until the step ends
(issue 11, item 5: a wedged worker's readiness said SERVING)."""

from __future__ import annotations

import threading
import time

from worker_svc.stream.stall_watch import StallWatch


def test_a_step_past_its_limit_turns_readiness_off_until_it_ends() -> None:
    states: list[bool] = []
    changed = threading.Event()

    def set_ready(is_ready: bool) -> None:
        states.append(is_ready)
        changed.set()

    watch = StallWatch(set_ready, floor_seconds=0.2, multiple=1.0)
    try:
        watch.step_started()
        watch.step_ended()  # a quick step: nothing to report
        assert states == [] and not watch.is_stalled
        watch.step_started()
        assert changed.wait(30), "a step past its limit never turned readiness off"
        assert states == [False] and watch.is_stalled
        watch.step_ended()
        assert states == [False, True] and not watch.is_stalled
    finally:
        watch.close()


def test_the_limit_follows_the_slowest_recent_step() -> None:
    watch = StallWatch(lambda is_ready: None, floor_seconds=5.0, multiple=20.0)
    try:
        assert watch.limit_seconds == 5.0
        watch.step_started()
        time.sleep(0.3)  # a step of at least 0.3 s
        watch.step_ended()
        assert watch.limit_seconds >= 20.0 * 0.3
    finally:
        watch.close()

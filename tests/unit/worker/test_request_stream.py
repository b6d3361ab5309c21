"""Requests read ahead of the step loop (worker_svc/stream/request_stream.py): in order, the stream's
end or error behind them, received before the loop asks, bounded, released on close."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from worker_svc.stream.request_stream import StepRequests


class Source:
    """A request stream that counts what the reader pulled from it."""

    def __init__(self, num_items: int | None, error: Exception | None = None) -> None:
        self.num_pulled = 0
        self.num_items = num_items
        self.error = error
        self.pulled = threading.Condition()

    def __iter__(self) -> Iterator[int]:
        while self.num_items is None or self.num_pulled < self.num_items:
            with self.pulled:
                self.num_pulled += 1
                self.pulled.notify_all()
            yield self.num_pulled
        if self.error is not None:
            raise self.error

    def wait_pulled(self, count: int) -> bool:
        with self.pulled:
            return self.pulled.wait_for(lambda: self.num_pulled >= count, timeout=5.0)


def test_requests_come_in_order_then_the_end_every_time() -> None:
    requests = StepRequests(iter(Source(5)))
    assert list(requests) == [1, 2, 3, 4, 5]
    with pytest.raises(StopIteration):
        next(requests)


def test_the_streams_error_comes_after_the_requests_read_before_it() -> None:
    requests = StepRequests(iter(Source(2, ConnectionError("peer gone"))))
    assert next(requests) == 1
    assert next(requests) == 2
    with pytest.raises(ConnectionError, match="peer gone"):
        next(requests)
    with pytest.raises(ConnectionError):  # and again: the loop cannot read past it
        next(requests)


def test_requests_are_received_before_the_loop_asks_for_them() -> None:
    source = Source(4)
    requests = StepRequests(iter(source))
    assert next(requests) == 1
    assert source.wait_pulled(4)  # read while the loop "steps" on the first
    assert list(requests) == [2, 3, 4]


def test_a_loop_that_stops_reading_holds_the_reader_and_close_releases_it() -> None:
    source = Source(None)  # a peer that never stops sending
    requests = StepRequests(iter(source), max_pending=2)
    assert source.wait_pulled(3)
    time.sleep(0.3)  # room for a reader that ignored the bound to run away
    assert source.num_pulled <= 3  # two queued, one held by the reader
    requests.close()
    requests._reader.join(timeout=5.0)
    assert not requests._reader.is_alive()

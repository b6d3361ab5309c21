"""An Execute stream's requests, read ahead of the step loop.

gRPC's synchronous server reads a streamed request only when the handler asks for it: each
`next()` on its request iterator starts a receive on the completion queue and waits for the
poller thread to hand the message back, ~0.4-0.5 ms on a 2-core machine even when the message
arrived long before. The step loop asked at the worst moment: after a step, for the next one
the core had already sent (async scheduling), and before sampling, for the deferred grammar masks
sent during the forward. Here a reader thread keeps a receive posted and queues what arrives;
the step loop takes requests from the queue, in order.

Bounded: at most `MAX_PENDING` requests wait, then the reader stops receiving, so gRPC's flow
control holds a peer that sends faster than the rank steps. The stream's end, or its error,
travels behind the requests read before it. A loop that stops reading (`close`) releases the
reader: it stops receiving, and the stream ends with its RPC.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

from worker_svc.stream.output_stream import StreamEnd, put_while

T = TypeVar("T")
MAX_PENDING = 16
"""Requests read but not yet taken by the step loop before the reader waits (the core keeps
at most two steps and their masks in flight)."""


class StepRequests(Generic[T]):
    """The requests of `requests`, read ahead on a thread of their own; iterate it like the
    stream itself (the step loop's thread)."""

    def __init__(self, requests: Iterator[T], max_pending: int = MAX_PENDING) -> None:
        self._queue: queue.Queue[T | StreamEnd] = queue.Queue(max_pending)
        self._is_closed = threading.Event()
        self._reader = threading.Thread(
            target=self._read, args=(requests,), name="execute-reader", daemon=True
        )
        self._reader.start()

    def __iter__(self) -> StepRequests[T]:
        return self

    def __next__(self) -> T:
        """The next request; StopIteration at the stream's end, or the stream's error."""
        item = self._queue.get()
        if isinstance(item, StreamEnd):
            self._queue.put(item)  # every later call ends the same way
            if item.error is not None:
                raise item.error
            raise StopIteration
        return item

    def close(self) -> None:
        """The loop reads no more: the reader stops queueing."""
        self._is_closed.set()

    def _read(self, requests: Iterator[T]) -> None:
        error: BaseException | None = None
        try:
            for request in requests:
                if not self._offer(request):
                    return
        except BaseException as e:  # noqa: BLE001 (handed to the step loop, which raises it)
            error = e
        self._offer(StreamEnd(error))

    def _offer(self, item: T | StreamEnd) -> bool:
        """Queue `item`, waiting for room while the loop reads; False once it stopped."""
        return put_while(self._queue, item, lambda: not self._is_closed.is_set())

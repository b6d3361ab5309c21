"""An Execute stream's outputs, sent beside the step loop instead of on it.

gRPC's synchronous server writes a streamed response on the thread that iterates the handler's
responses and waits there until the write completes (a hand-off to its completion-queue thread
and back). With the steps run on that thread, every output's write sat between two steps: the
next step, already queued by the core (async scheduling), waited for it. Here the step loop runs
on a thread of its own (`StepOutputs.run`) and `put`s each output; the RPC thread `drain`s them
into gRPC, in order, while the next step runs.

Bounded: at most `MAX_PENDING` outputs wait, so a core that stops reading holds the step loop
rather than piling outputs up. The loop's end travels behind its outputs: the stream ends (or
fails, with the loop's exception, e.g. an abort's status) only after every output put before it
has been handed to gRPC; none is dropped. A stream that gRPC stopped draining (cancelled, the
peer gone) fails the loop's next `put` with StreamClosed, so the loop stops visibly.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
MAX_PENDING = 4
"""Outputs that may wait to be written before the step loop waits for the writer."""
POLL_SECONDS = 0.1
"""How often a loop held by a full queue checks that the stream is still being drained."""


class StreamClosed(Exception):
    """The stream no longer takes outputs (its RPC ended or was cancelled)."""


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """A stream's end, queued behind its items; `error` when it failed."""

    error: BaseException | None


U = TypeVar("U")


def put_while(items: queue.Queue[U], item: U, is_open: Callable[[], bool]) -> bool:
    """Put `item` in the bounded `items`, waiting for room while `is_open()`; False once not."""
    while is_open():
        try:
            items.put(item, timeout=POLL_SECONDS)
            return True
        except queue.Full:
            continue
    return False


class StepOutputs(Generic[T]):
    """Outputs from a step loop thread to the RPC thread; see the module docstring.

    `is_active` says whether the RPC is still live (grpc.ServicerContext.is_active)."""

    def __init__(self, is_active: Callable[[], bool], max_pending: int = MAX_PENDING) -> None:
        self._queue: queue.Queue[T | StreamEnd] = queue.Queue(max_pending)
        self._is_active = is_active
        self._is_closed = threading.Event()

    def put(self, output: T) -> None:
        """Queue `output` behind the earlier ones (step loop thread); waits while `max_pending`
        are waiting; raises StreamClosed once the stream is no longer drained."""
        if not self._offer(output):
            raise StreamClosed("the Execute stream was closed; the step loop stops")

    def run(self, loop: Callable[[], None], name: str) -> threading.Thread:
        """Start `loop` on a thread of its own; its return or exception ends the stream after
        the outputs it put."""

        def target() -> None:
            error: BaseException | None = None
            try:
                loop()
            except StreamClosed as e:
                logger.warning("%s stopped: %s", name, e)
                error = e
            except BaseException as e:  # noqa: BLE001 (handed to the RPC thread, which raises it)
                error = e
            self._offer(StreamEnd(error))

        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        return thread

    def drain(self) -> Iterator[T]:
        """The outputs in order (RPC thread), until the loop ends; raises the loop's exception."""
        try:
            while True:
                item = self._queue.get()
                if isinstance(item, StreamEnd):
                    if item.error is not None:
                        raise item.error
                    return
                yield item
        finally:
            self._is_closed.set()

    def _offer(self, item: T | StreamEnd) -> bool:
        """Put `item`, waiting for room while the stream is drained; False once it is not."""
        return put_while(
            self._queue, item, lambda: not self._is_closed.is_set() and self._is_active()
        )

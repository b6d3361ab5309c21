"""The engine core's side of structured outputs: requests waiting for their grammar (vLLM's
WAITING_FOR_FSM, kept outside the scheduler so they block no one) and each step's grammar
bitmask (vLLM's Scheduler.get_grammar_bitmask).

A step's bitmask can be filled only when every constrained request that samples in it has all
its earlier tokens applied: the matcher follows the applied tokens, never placeholders. Under
async scheduling a decode is scheduled while the step before it is still in flight, so its mask
waits for that step's output (vLLM's pending_structured_output_tokens): the step goes to the
ranks without it (`has_pending_grammar`), they run its forward, and the engine sends the mask as
soon as it applied the older step (GrammarOutput), before the ranks sample.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from core_svc.request import Request, RequestStatus
from core_svc.scheduler_output import GrammarBitmask, SchedulerOutput
from core_svc.structured_output import StructuredOutputManager, StructuredOutputsConfig

_RUNNING = RequestStatus.RUNNING


class StructuredRequests:
    """Requests compiling their grammar, and the step bitmasks; busy-loop thread only."""

    def __init__(
        self,
        vocab_size: int,
        config: StructuredOutputsConfig,
        wake: Callable[[], None] = lambda: None,
    ) -> None:
        self.manager = StructuredOutputManager(vocab_size, config, wake)
        self._wake = wake
        self.compiling: dict[int, Request] = {}
        """req_handle -> request whose grammar compiles (not in the scheduler yet)."""

    def submit(self, request: Request) -> str | None:
        """Start compiling the request's grammar; returns why it cannot be."""
        state = request.structured_output
        assert state is not None
        problem = self.manager.submit(
            request.req_handle, request.client_id, state, request.output_token_ids
        )
        if problem is None:
            self.compiling[request.req_handle] = request
            timer = threading.Timer(self.manager.config.compile_timeout_s + 0.01, self._wake)
            timer.daemon = True
            timer.start()  # wakes the loop to refuse a grammar past its time limit
        return problem

    @property
    def has_news(self) -> bool:
        """Some compile finished or ran out of time (the loop has something to do)."""
        return bool(self.compiling) and self.manager.has_news(time.monotonic())

    def take_ready(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Requests whose grammar is ready, and those refused with why."""
        ready_handles, failed_handles = self.manager.take_compiled(time.monotonic())
        ready = [self.compiling.pop(h) for h in ready_handles]
        failed = [(self.compiling.pop(h), why) for h, why in failed_handles]
        return ready, failed

    def take_compiling(self, requests: Iterable[Request]) -> list[Request]:
        """Of `requests`, those still compiling, forgotten here (they are being aborted)."""
        taken = []
        for request in requests:
            if self.compiling.pop(request.req_handle, None) is not None:
                self.manager.cancel(request.req_handle)
                taken.append(request)
        return taken

    def fill(self, step: SchedulerOutput, rows: list[tuple[Request, int]]) -> bool:
        """Give the step its bitmask: True when filled (or none is needed), False when a
        request's earlier token is still in flight (the step is marked pending; fill it
        again once the older step is applied)."""
        candidates = [
            (request, position)
            for request, position in rows
            if request.status is _RUNNING
            and request.structured_output is not None
            and request.structured_output.may_need_bitmask
        ]
        if any(len(request.all_token_ids) < position for request, position in candidates):
            step.has_pending_grammar = True  # its token in flight may also end the reasoning
            return False
        live = [(r, p) for r, p in candidates if r.structured_output.needs_bitmask]  # type: ignore[union-attr]
        if live:
            states = [request.structured_output for request, _ in live]
            step.grammar_bitmask = GrammarBitmask(
                [request.req_handle for request, _ in live],
                self.manager.fill_bitmask(states),  # type: ignore[arg-type]
            )
        return True

    def shutdown(self) -> None:
        self.manager.shutdown()

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
from core_svc.sched.scheduler_output import GrammarBitmask, SchedulerOutput
from core_svc.structured_output.manager import StructuredOutputManager, StructuredOutputsConfig
from splitserve_contracts.spec_decode import SpeculativeConfig, propose_ngram

_RUNNING = RequestStatus.RUNNING


class StructuredRequests:
    """Requests compiling their grammar, and the step bitmasks; busy-loop thread only."""

    def __init__(
        self,
        vocab_size: int,
        config: StructuredOutputsConfig,
        wake: Callable[[], None] = lambda: None,
        speculative_config: SpeculativeConfig | None = None,
        max_model_len: int = 0,
    ) -> None:
        self.manager = StructuredOutputManager(vocab_size, config, wake)
        self.speculative_config = speculative_config
        """How the ranks propose drafts: a constrained request's masks cover its drafts."""
        self.max_model_len = max_model_len
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
        again once the older step is applied). `rows`: the constrained requests that sample,
        each with its draft slots (its placeholders beyond this step's are tokens in flight)."""
        candidates = [
            (request, num_spec)
            for request, num_spec in rows
            if request.status is _RUNNING
            and request.structured_output is not None
            and request.structured_output.may_need_bitmask
        ]
        if any(request.num_output_placeholders > 1 + k for request, k in candidates):
            step.has_pending_grammar = True  # its token in flight may also end the reasoning
            return False
        live = [(r, k) for r, k in candidates if r.structured_output.needs_bitmask]  # type: ignore[union-attr]
        if not live:
            return True
        states = [request.structured_output for request, _ in live]
        if not any(k for _, k in live):
            step.grammar_bitmask = GrammarBitmask(
                [request.req_handle for request, _ in live],
                self.manager.fill_bitmask(states),  # type: ignore[arg-type]
            )
            return True
        drafts = [self._valid_drafts(request, k) for request, k in live]
        handles = [r.req_handle for (r, _), d in zip(live, drafts, strict=True) for _ in (0, *d)]
        step.grammar_bitmask = GrammarBitmask(
            handles,
            self.manager.fill_bitmask(states, drafts),  # type: ignore[arg-type]
        )
        return True

    def _valid_drafts(self, request: Request, num_spec: int) -> list[int]:
        """The drafts the ranks propose for the request (the same function of the same tokens),
        up to the first its grammar refuses: the rank rejects that one under the mask before
        it, so no mask follows it."""
        spec = self.speculative_config
        if not num_spec or spec is None:
            return []
        drafts = propose_ngram(
            request.all_token_ids,
            spec.prompt_lookup_min,
            spec.prompt_lookup_max,
            num_spec,
            self.max_model_len,
        ).tolist()
        state = request.structured_output
        assert state is not None and state.matcher is not None
        return drafts[: state.matcher.validate_tokens(drafts)] if drafts else []

    def shutdown(self) -> None:
        self.manager.shutdown()

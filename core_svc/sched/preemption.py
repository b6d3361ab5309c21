"""Preemption by recompute: when a running request's next tokens find no free KV blocks,
victims give theirs back and return to the front of the waiting queue (vLLM's `_preempt_request`).

A victim keeps its tokens and loses its KV: it is computed again from its prompt and the tokens
it generated when it is admitted again. The same path puts every request back when the ranks
lost their state (`requeue_all`).
"""

from __future__ import annotations

from collections.abc import Sequence

from core_svc.kv_cache.block_pool import KVCacheBlock
from core_svc.request import Request, RequestStatus
from core_svc.sched.scheduler_state import SchedulerState
from core_svc.sched.step_builder import StepBuilder
from splitserve_contracts.output_types import EngineCoreEventType


class Preemption(SchedulerState):
    """The scheduler's preemption: victims chosen by policy, their state dropped, requeued."""

    def _preempt_until_allocated(
        self,
        request: Request,
        num_new_tokens: int,
        step: StepBuilder,
        token_budget: int,
        index: int,
    ) -> tuple[Sequence[KVCacheBlock] | None, int, int]:
        """Preempt victims until the request's slots fit. Returns its new blocks (None when
        it had to preempt itself), the budget and its index in `running`, both adjusted
        when a victim scheduled earlier in this step is taken back out of it."""
        while True:
            victim = self._pop_victim()
            num_returned = step.remove_running(victim)
            if num_returned is not None:
                token_budget += num_returned
                index -= 1
                self.encoder.cancel(victim, step.remove_encoder_inputs(victim))
            self.num_preemptions += 1
            self._requeue(victim)  # recompute: blocks dropped, back to the queue's front
            if victim is request:
                return None, token_budget, index
            blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if blocks is not None:
                return blocks, token_budget, index

    def _pop_victim(self) -> Request:
        """FCFS: the last running request; priority: the lowest-ranked (largest (priority,
        arrival)) one, which may already be scheduled this step."""
        if self.policy == "fcfs":
            return self.running.pop()
        victim = max(self.running, key=lambda r: (r.priority, r.req_handle))
        self.running.remove(victim)
        return victim

    def _requeue(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.lora.release(request)
        if request.mm_features:
            self.encoder.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # what steps in flight sample for it is dropped
        request.num_preemptions += 1
        request.record_event(EngineCoreEventType.PREEMPTED)
        self.waiting.prepend_request(request)
        self.num_waiting_tokens += request.num_tokens

    def requeue_all(self) -> None:
        """The ranks lost every request's state (a rank restarted): each running request goes
        back to the waiting queue, in its order, to be computed again from its prompt and the
        tokens it generated (preemption by recompute, not counted as a preemption), and the
        ranks of the next bring-up get every request as new (images included: their encoders
        run again)."""
        for request in reversed(self.running):
            self._requeue(request)
        self.running = []
        self.encoder.reset()  # the new ranks' encoder caches start empty
        self.lora.reset()  # and their LoRA slots
        for request in self.requests.values():
            request.is_known_to_workers = False
            request.num_sent_token_ids = 0
            if request.trace is not None:
                request.trace.num_recoveries += 1
        self.finished_req_handles = []
        self._in_flight.clear()  # the steps in flight are lost with the ranks

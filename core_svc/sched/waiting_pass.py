"""Pass 2 of a step: admit waiting requests with the budgets pass 1 left (vLLM's WAITING loop
in `Scheduler.schedule`).

A request is admitted whole or not at all: its prefix-cache hit is looked up, its whole
sequence must fit the free KV blocks, and its first chunk joins the step (new, or resumed
after a preemption). The scheduler skips this pass in a step that preempted. With a KV
connector a request may load its prompt from a peer instead (kv_transfers.py): it leaves the
queue to wait for its KV, and comes back with it (its blocks held, all but one prompt token
computed).
"""

from __future__ import annotations

from core_svc.kv_cache.block_pool import KVCacheBlock
from core_svc.request import Request, RequestStatus
from core_svc.sched.kv_transfers import KVTransfers
from core_svc.sched.step_builder import StepBuilder
from splitserve_contracts.output_types import EngineCoreEventType


class WaitingPass(KVTransfers):
    """The scheduler's pass over its waiting queue."""

    def _schedule_waiting(
        self,
        step: StepBuilder,
        token_budget: int,
        threshold: int,
        prefill_budget: int,
        now: float,
    ) -> int:
        """Pass 2: admit waiting requests while budgets and sequence slots last; the first
        that does not fit (its whole sequence must fit) stops it. A request whose LoRA adapter
        cannot join the step's (no adapter slot is free) is passed over: it keeps its place and waits,
        the requests behind it are tried (vLLM's rule). Returns the prefill budget left."""
        kv = self.kv_cache_manager
        connector = self.kv_connector
        num_admitted = 0
        token_budget = min(token_budget, prefill_budget)
        passed_over: list[Request] = []
        hit_blocks: list[KVCacheBlock]
        while self.waiting and token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek_request()
            if request.lora is not None and not self.lora.can_run(request.lora):
                passed_over.append(self.waiting.pop_request())
                continue
            num_computed = request.num_computed_tokens
            if num_computed:  # its KV was loaded from a peer into the blocks it holds
                hit_blocks, num_hit_tokens = [], num_computed
            else:
                hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
                if connector is not None:
                    left = self._admit_remote(connector, request, hit_blocks, num_hit_tokens)
                    if left is None:
                        break
                    if left:
                        continue
            num_new_tokens = min(request.num_tokens - num_hit_tokens, token_budget)
            if self.is_encoder_only:
                if num_new_tokens < request.num_tokens:
                    break  # whole prompts only: it waits for a step with room for all of it
            elif 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            encoder_inputs = None
            if request.mm_features:
                num_new_tokens, encoder_inputs = self.encoder.plan(
                    request, num_hit_tokens, num_new_tokens
                )
                if num_new_tokens <= 0:
                    break
            blocks = kv.allocate_slots(
                request,
                num_new_tokens,
                num_hit_tokens - num_computed,
                hit_blocks,
                full_sequence_must_fit=True,
            )
            if blocks is None:
                break
            self.waiting.pop_request()
            self._start_running(request, step, num_hit_tokens, num_new_tokens, now)
            if encoder_inputs:
                self.encoder.commit(request, encoder_inputs)
                step.add_encoder_inputs(request, encoder_inputs)
            request.num_computed_tokens += num_new_tokens
            token_budget -= num_new_tokens
            num_admitted += num_new_tokens
        if passed_over:
            self.waiting.prepend_requests(passed_over)
        return prefill_budget - num_admitted

    def _start_running(
        self, request: Request, step: StepBuilder, num_hit_tokens: int, num_new: int, now: float
    ) -> None:
        """A waiting request admitted with its slots allocated joins the running ones and the
        step (new, or resumed after a preemption)."""
        kv = self.kv_cache_manager
        self.num_waiting_tokens -= request.num_tokens
        if not request.num_computed_tokens:  # a loaded request counted its hit when it parked
            kv.record_prefix_cache_stats(request, num_hit_tokens)
            if self.kv_connector is not None and not request.num_preemptions:
                self.num_external_queries += request.num_tokens - num_hit_tokens  # no hit
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens
        request.record_event(EngineCoreEventType.SCHEDULED, now)
        self.running.append(request)
        if request.lora is not None:
            self.lora.acquire(request)
        block_ids = kv.get_block_ids(request)
        state_slot = kv.get_state_slot(request)
        if request.is_known_to_workers:
            step.add_resumed(request, num_new, block_ids, state_slot)
        else:
            step.add_new(request, num_new, block_ids, state_slot)

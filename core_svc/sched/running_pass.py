"""Pass 1 of a step: the running requests, served first, each with its next tokens (vLLM's
RUNNING loop in `Scheduler.schedule`).

A decode gets one token (plus draft slots with speculative decoding), a prefill chunk the
tokens the budgets leave; when a request's tokens find no free KV blocks, the last requests
(by policy) are preempted until they do (`preemption.py`).
"""

from __future__ import annotations

from core_svc.request import Request
from core_svc.sched.preemption import Preemption
from core_svc.sched.step_builder import StepBuilder


class RunningPass(Preemption):
    """The scheduler's pass over its running requests."""

    def _schedule_running(
        self, step: StepBuilder, threshold: int, prefill_budget: int
    ) -> tuple[int, int, bool]:
        """Pass 1 over RUNNING requests (the hot path of a decode-heavy step); returns the
        token and prefill budgets left and whether it preempted. A prefill chunk (more than
        one new token) also spends `prefill_budget`; a preempted victim's chunk stays spent
        (the step just carries fewer prefill tokens)."""
        token_budget = self.max_num_batched_tokens
        max_model_len = self.max_model_len
        allocate_slots = self.kv_cache_manager.allocate_slots
        add_running = step.add_running
        running = self.running
        num_spec_max = self._num_spec_by_batch[len(running)] if self._num_spec_by_batch else 0
        preempted = False
        i = 0
        while i < len(running) and token_budget > 0:
            request = running[i]
            num_computed = request.num_computed_tokens
            num_new_tokens = len(request.all_token_ids) - num_computed
            placeholders = request.num_output_placeholders
            if placeholders:  # async scheduling: tokens still being sampled count as known
                if len(request.output_token_ids) + placeholders >= request.max_tokens:
                    i += 1  # the steps in flight already sample its last token
                    continue
                num_new_tokens += placeholders
            is_prefill = num_new_tokens > 1
            if is_prefill:
                if 0 < threshold < num_new_tokens:
                    num_new_tokens = threshold
                if num_new_tokens > prefill_budget:
                    num_new_tokens = prefill_budget
            elif num_spec_max and num_new_tokens == 1:
                num_new_tokens += self._num_spec_slots(request, num_spec_max, placeholders)
            if num_new_tokens > token_budget:
                num_new_tokens = token_budget
            if num_new_tokens > max_model_len - 1 - num_computed:
                num_new_tokens = max_model_len - 1 - num_computed
            encoder_inputs = None
            if request.mm_features and num_new_tokens > 0:
                num_new_tokens, encoder_inputs = self.encoder.plan(
                    request, num_computed, num_new_tokens
                )
            if num_new_tokens <= 0:
                i += 1
                continue
            num_spec = 0 if is_prefill else num_new_tokens - 1
            blocks = allocate_slots(request, num_new_tokens)
            if blocks is None and num_spec:  # drafts never preempt anyone
                num_new_tokens, num_spec = 1, 0
                blocks = allocate_slots(request, 1)
            if blocks is None:
                preempted = True
                blocks, token_budget, i = self._preempt_until_allocated(
                    request, num_new_tokens, step, token_budget, i
                )
                if blocks is None:
                    break
            add_running(request, num_new_tokens, blocks, num_spec)
            if encoder_inputs:
                self.encoder.commit(request, encoder_inputs)
                step.add_encoder_inputs(request, encoder_inputs)
            request.num_computed_tokens = num_computed + num_new_tokens
            token_budget -= num_new_tokens
            if is_prefill:
                prefill_budget -= num_new_tokens
            i += 1
        return token_budget, prefill_budget, preempted

    @staticmethod
    def _num_spec_slots(request: Request, num_spec_max: int, num_placeholders: int) -> int:
        """Draft slots for a decoding request: no more than the tokens it may still sample
        beyond the one it samples anyway, and none while a constrained request reasons
        (its grammar is not applied yet, so draft positions would have no masks)."""
        room = request.max_tokens - len(request.output_token_ids) - num_placeholders - 1
        grammar = request.structured_output
        if room <= 0 or (grammar is not None and not grammar.reasoning_ended):
            return 0
        return num_spec_max if num_spec_max < room else room

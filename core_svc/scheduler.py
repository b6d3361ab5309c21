"""The vLLM V1 scheduler: one token budget per step shared by prefill chunks and decodes."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Sequence

from core_svc.block_hash import BlockHasher
from core_svc.block_pool import KVCacheBlock
from core_svc.encoder_scheduler import EncoderScheduler
from core_svc.engine_outputs import make_final_outputs, make_update_outputs
from core_svc.kv_cache_manager import KVCacheManager
from core_svc.lora_slots import LoraSlotTable
from core_svc.outputs import EngineCoreOutputs
from core_svc.prefill_policy import PrefillPolicy
from core_svc.request import Request, RequestStatus
from core_svc.request_queue import create_request_queue
from core_svc.scheduler_config import CacheConfig, SchedulerConfig
from core_svc.scheduler_output import SchedulerOutput
from core_svc.step_builder import StepBuilder
from core_svc.step_update import ScheduledStep, SpecDecodingStats, StepUpdate, StepUpdater
from splitserve_contracts.output_types import EngineCoreEventType, ErrorKind, ModelRunnerOutput

logger = logging.getLogger(__name__)


_RUNNING = RequestStatus.RUNNING


class Scheduler:
    """Decides, every step, how many tokens each request computes.

    There is no prefill or decode phase: each request has `num_computed_tokens` and the
    scheduler hands out tokens so it catches up with `num_tokens`, within one token
    budget per step. That one rule covers chunked prefill, prefix hits, resumption after
    preemption and decoding. Running requests are served first (preempting the last
    ones by recompute when blocks run out); waiting requests are admitted with what is
    left, unless something was preempted this step.

    Invariants: every request in `requests` is in exactly one of `running` (status
    RUNNING) or `waiting` (WAITING or PREEMPTED, 0 computed tokens, no blocks).

    This scheduler runs in lockstep: one step in flight, applied before the next is built.
    AsyncScheduler (core_svc/async_scheduler.py) schedules ahead through the hooks
    `_after_schedule` and `_after_update`.
    """

    max_steps_in_flight = 1
    """Steps the engine may send before it applies the oldest one's output."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        kv_cache_manager: KVCacheManager,
    ) -> None:
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.prefill_policy = PrefillPolicy(scheduler_config)
        """The caps on prompt tokens per step, static or adaptive."""
        self.is_encoder_only = scheduler_config.is_encoder_only
        """Prompts are computed whole, in one step (no chunked prefill)."""
        self.policy = scheduler_config.policy
        self.enable_caching = cache_config.enable_prefix_caching
        self.kv_cache_manager = kv_cache_manager
        self.block_hasher = BlockHasher(cache_config.block_size)
        budget = scheduler_config.encoder_compute_budget
        self.encoder = EncoderScheduler(budget, budget, scheduler_config.disable_chunked_mm_input)
        """Encoder inputs of multimodal requests (idle for text-only ones)."""
        self.lora = LoraSlotTable(scheduler_config.max_loras)
        """The LoRA adapters of the requests and the workers' slots (idle without LoRA)."""
        self._updater = StepUpdater(
            kv_cache_manager,
            self.block_hasher,
            self.encoder,
            max_model_len=self.max_model_len,
            vocab_size=scheduler_config.vocab_size,
        )
        spec = scheduler_config.speculative_config
        self._num_spec_by_batch = spec.num_spec_tokens_for_batch(self.max_num_seqs) if spec else []
        """Draft slots per decoding request by the number of running requests (speculative
        decoding; empty: off)."""
        self.spec_stats = SpecDecodingStats(spec.num_speculative_tokens if spec else 0)
        self.requests: dict[int, Request] = {}
        self.waiting = create_request_queue(scheduler_config.policy)
        self.running: list[Request] = []
        self.finished_req_handles: list[int] = []
        """Handles the workers know and must drop, sent with the next SchedulerOutput."""
        self.traced_finished: list[Request] = []
        """Traced requests freed since the loop last took them (their spans to build)."""
        self.step_id = 0
        self.num_preemptions = 0
        self.num_waiting_tokens = 0
        """Tokens of the waiting requests (to compute when they are admitted)."""
        self.num_scheduled_tokens = 0
        """Tokens scheduled in the latest step."""
        self.num_prompt_tokens = 0
        """Prompt tokens of the requests that have sampled their first token (vLLM's prompt
        throughput counts a prompt when its first token arrives), since the engine started."""
        self.num_generation_tokens = 0
        """Tokens sampled since the engine started."""
        self.num_structured = 0
        """Requests with a grammar among `requests` (0: steps skip the grammar work)."""
        self._in_flight: deque[ScheduledStep] = deque()
        """Scheduled steps whose outputs are not applied yet, oldest first (at most
        `max_steps_in_flight`)."""

    def add_request(self, request: Request) -> None:
        if self.enable_caching:
            self.block_hasher.extend(
                request.block_hashes,
                request.all_token_ids,
                request.cache_salt,
                request.mm_features,
                request.lora_hash_key,
            )
        self.requests[request.req_handle] = request
        if request.structured_output is not None:
            self.num_structured += 1
        if request.lora is not None:
            self.lora.add(request)
        self.waiting.add_request(request)
        self.num_waiting_tokens += request.num_tokens
        request.record_event(EngineCoreEventType.QUEUED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_finished_requests(self) -> bool:
        return bool(self.finished_req_handles)

    def schedule(self) -> SchedulerOutput:
        """Build the next step and advance num_computed_tokens optimistically by it."""
        self.step_id += 1
        step = StepBuilder(self.step_id, self.finished_req_handles)
        self.finished_req_handles = []
        self.encoder.begin_step()
        threshold, max_prefill = self.prefill_policy.limits(self.running, len(self.waiting))
        token_budget, prefill_budget, preempted = self._schedule_running(
            step, threshold, max_prefill
        )
        if not preempted:
            prefill_budget = self._schedule_waiting(
                step, token_budget, threshold, prefill_budget, time.monotonic()
            )
        self.prefill_policy.num_prefill_tokens = max_prefill - prefill_budget
        output, scheduled = step.build()
        output.free_encoder_mm_hashes = self.encoder.take_freed()
        output.lora_slots, output.free_lora_ids = self.lora.take_changes()
        self.num_scheduled_tokens = output.total_num_scheduled_tokens
        num_computed = [request.num_computed_tokens for request in scheduled]
        in_flight = ScheduledStep(self.step_id, scheduled, num_computed)
        if self.num_structured:
            in_flight.structured = self._structured_rows(scheduled, num_computed)
        self._after_schedule(in_flight)
        self._in_flight.append(in_flight)
        return output

    @staticmethod
    def _structured_rows(
        scheduled: list[Request], num_computed: list[int]
    ) -> list[tuple[Request, int]]:
        """The constrained requests that sample in the step (their scheduled tokens reach the
        end of what is known, placeholders included), each with its draft slots."""
        rows = []
        for request, position in zip(scheduled, num_computed, strict=True):
            if request.structured_output is not None:
                num_spec = position - len(request.all_token_ids) - request.num_output_placeholders
                if num_spec >= 0:
                    rows.append((request, num_spec))
        return rows

    def structured_rows(self, step_id: int) -> list[tuple[Request, int]]:
        """The constrained sampling requests of the step in flight `step_id`, each with its
        draft slots."""
        for scheduled in reversed(self._in_flight):
            if scheduled.step_id == step_id:
                return scheduled.structured
        return []

    def _after_schedule(self, scheduled: ScheduledStep) -> None:
        """Hook: the step is built and about to be sent (AsyncScheduler: output placeholders)."""

    def _after_update(self, update: StepUpdate) -> None:
        """Hook: a step's output was applied (AsyncScheduler: placeholders taken back)."""

    @property
    def has_steps_in_flight(self) -> bool:
        return bool(self._in_flight)

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
        cannot join the step's (`max_loras`) is passed over: it keeps its place and waits,
        the requests behind it are tried (vLLM's rule). Returns the prefill budget left."""
        kv = self.kv_cache_manager
        num_admitted = 0
        token_budget = min(token_budget, prefill_budget)
        passed_over: list[Request] = []
        while self.waiting and token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek_request()
            if request.lora is not None and not self.lora.can_run(request.lora):
                passed_over.append(self.waiting.pop_request())
                continue
            hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
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
                request, num_new_tokens, num_hit_tokens, hit_blocks, full_sequence_must_fit=True
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
        kv.record_prefix_cache_stats(request, num_hit_tokens)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens
        request.record_event(EngineCoreEventType.SCHEDULED, now)
        self.running.append(request)
        if request.lora is not None:
            self.lora.acquire(request)
        block_ids = kv.get_block_ids(request)
        if request.is_known_to_workers:
            step.add_resumed(request, num_new, block_ids)
        else:
            step.add_new(request, num_new, block_ids)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """Apply one step's sampled tokens and free the requests that finished; returns the
        outputs per client_id. Requests aborted (or, with a step scheduled ahead, finished or
        preempted) while the step ran are skipped: what they sampled is dropped. Requests the
        ranks refused for their own invalid data end with INVALID_REQUEST; a request whose
        scheduled tokens reached its end but sampled nothing, or sampled an id outside the
        vocabulary (a broken output rank), ends with ENGINE_FAILURE instead of stalling."""
        scheduled = self._in_flight.popleft()
        update = self._updater.apply(
            scheduled, scheduler_output, model_runner_output, self.requests, self.spec_stats
        )
        self._after_update(update)
        self.num_prompt_tokens += update.num_prompt_tokens
        self.num_generation_tokens += len(update.sampled_token_ids)
        if update.spec_reqs:
            self._roll_back_rejected(update)
        outputs = make_update_outputs(update, model_runner_output, scheduled.step_id)
        finished = update.finished + update.failed
        if finished:
            for request in finished:
                self._free_request(request)
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    @staticmethod
    def _roll_back_rejected(update: StepUpdate) -> None:
        """Draft slots whose drafts were rejected (or never proposed) have no KV: the requests'
        num_computed_tokens fall back by them (vLLM's rejection rollback); their blocks stay
        allocated and the next tokens overwrite the slots."""
        for request, num_spec, num_sampled in update.spec_reqs:
            request.num_computed_tokens -= num_spec - (num_sampled - 1)

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        if request.mm_features:
            self.encoder.free(request)
        if self.requests.pop(request.req_handle, None) is not None:
            self.num_structured -= request.structured_output is not None
            if request.lora is not None:
                self.lora.remove(request)
        if request.is_known_to_workers:
            self.finished_req_handles.append(request.req_handle)
        if request.trace is not None:
            request.trace.finished_at = time.monotonic()
            self.traced_finished.append(request)

    def finish_requests(self, requests: Iterable[Request], status: RequestStatus) -> None:
        """Finish unfinished requests with a final status (abort, error) and free them."""
        removed_running = False
        removed_waiting = []
        for request in requests:
            if request.is_finished:
                continue
            if request.status == _RUNNING:
                removed_running = True
            else:
                removed_waiting.append(request)
            request.finish(status)
            self._free_request(request)
        if removed_running:
            self.running = [r for r in self.running if not r.is_finished]
        if removed_waiting:
            self.waiting.remove_requests(removed_waiting)
            self.num_waiting_tokens -= sum(r.num_tokens for r in removed_waiting)

    def drop_steps_in_flight(self) -> None:
        """The steps in flight will never be applied (the executor is gone)."""
        self._in_flight.clear()

    def fail_all(self, kind: ErrorKind, message: str) -> dict[int, EngineCoreOutputs]:
        """Finish every request with ERROR (engine failure, shutdown); one detail per request
        per client."""
        requests = list(self.requests.values())
        for request in requests:
            request.error_kind, request.error_message = kind, message
        self.finish_requests(requests, RequestStatus.FINISHED_ERROR)
        return make_final_outputs(requests)

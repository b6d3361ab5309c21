"""The vLLM V1 scheduler: one token budget per step shared by prefill chunks and decodes."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from core_svc.outputs import EngineCoreOutputs
from core_svc.request import Request, RequestStatus
from core_svc.sched.engine_outputs import make_final_outputs, make_update_outputs, merge_outputs
from core_svc.sched.running_pass import RunningPass
from core_svc.sched.scheduler_output import SchedulerOutput
from core_svc.sched.step_builder import StepBuilder
from core_svc.sched.step_update import ScheduledStep, StepUpdate
from core_svc.sched.waiting_pass import WaitingPass
from splitserve_contracts.output_types import EngineCoreEventType, ErrorKind, ModelRunnerOutput

logger = logging.getLogger(__name__)


_RUNNING = RequestStatus.RUNNING
_LOADING = RequestStatus.WAITING_FOR_REMOTE_KVS


class Scheduler(RunningPass, WaitingPass):
    """Decides, every step, how many tokens each request computes.

    There is no prefill or decode phase: each request has `num_computed_tokens` and the
    scheduler hands out tokens so it catches up with `num_tokens`, within one token
    budget per step. That one rule covers chunked prefill, prefix hits, resumption after
    preemption and decoding. Running requests are served first (preempting the last
    ones by recompute when blocks run out); waiting requests are admitted with what is
    left, unless something was preempted this step.

    Invariants: every request in `requests` is in exactly one of `running` (status
    RUNNING), `waiting` (WAITING or PREEMPTED, 0 computed tokens, no blocks; but for a request
    whose KV a connector loaded: its blocks, all but its last prompt token computed) or
    `loading` (WAITING_FOR_REMOTE_KVS, with a KV connector only: kv_transfers.py).

    This scheduler runs in lockstep: one step in flight, applied before the next is built.
    AsyncScheduler (core_svc/sched/async_scheduler.py) schedules ahead through the hooks
    `_after_schedule` and `_after_update`.

    Its state is `SchedulerState` (scheduler_state.py) and its passes are their own modules:
    running requests (running_pass.py), preemption (preemption.py), waiting requests
    (waiting_pass.py); this class builds the step from them and applies its output.
    """

    max_steps_in_flight = 1
    """Steps the engine may send before it applies the oldest one's output."""

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

    def has_requests_to_step(self) -> bool:
        """Requests a step may schedule (those waiting for their KV to arrive are not)."""
        return len(self.requests) > len(self.loading)

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
        if self.kv_connector is not None:
            self._add_connector_meta(self.kv_connector, output)
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
        if self.kv_connector is not None:
            self._apply_connector_output(self.kv_connector, model_runner_output.kv_connector_output)
        finished = update.finished + update.failed
        if finished:  # freed before their outputs are made: a KV connector's handoff joins them
            for request in finished:
                self._free_request(request)
            self.running = [r for r in self.running if not r.is_finished]
        outputs = make_update_outputs(update, model_runner_output, scheduled.step_id)
        if self.refused:
            merge_outputs(outputs, self._take_refused())
        return outputs

    def _take_refused(self) -> dict[int, EngineCoreOutputs]:
        refused, self.refused = self.refused, []
        return make_final_outputs(refused)

    @staticmethod
    def _roll_back_rejected(update: StepUpdate) -> None:
        """Draft slots whose drafts were rejected (or never proposed) have no KV: the requests'
        num_computed_tokens fall back by them (vLLM's rejection rollback); their blocks stay
        allocated and the next tokens overwrite the slots."""
        for request, num_spec, num_sampled in update.spec_reqs:
            request.num_computed_tokens -= num_spec - (num_sampled - 1)

    def _free_request(self, request: Request) -> None:
        connector = self.kv_connector
        if connector is None or not self._keeps_blocks(connector, request):
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
            elif request.status != _LOADING:
                removed_waiting.append(request)
            request.finish(status)
            self._free_request(request)
        if removed_running:
            self.running = [r for r in self.running if not r.is_finished]
        if removed_waiting:
            self.waiting.remove_requests(removed_waiting)
            self.num_waiting_tokens -= sum(r.num_tokens for r in removed_waiting)

    def requeue_all(self) -> None:
        if self.kv_connector is not None:
            self._drop_kv_transfers(self.kv_connector)
        super().requeue_all()

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
        outputs = make_final_outputs(requests)
        return merge_outputs(outputs, self._take_refused()) if self.refused else outputs

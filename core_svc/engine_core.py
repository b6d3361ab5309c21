"""EngineCore: the scheduler, the KV-cache manager and an executor, stepped in lockstep
(vLLM's EngineCore). Single-threaded: EngineCoreProc drives it from one thread."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from core_svc.admission import kv_capacity_problem, overload_reason
from core_svc.async_scheduler import AsyncScheduler
from core_svc.batch_queue import BatchQueue
from core_svc.client_requests import ClientRequests
from core_svc.engine_outputs import make_final_outputs, merge_outputs
from core_svc.executor import Executor, ExecutorError, Fault
from core_svc.kv_cache_manager import KVCacheManager
from core_svc.kv_events import KVEventBatch, KVEventRecorder
from core_svc.outputs import EngineCoreOutputs
from core_svc.request import Request, RequestStatus
from core_svc.request_checks import invalid_request_reason
from core_svc.scheduler import Scheduler
from core_svc.scheduler_config import CacheConfig, SchedulerConfig
from core_svc.scheduler_output import SchedulerOutput
from core_svc.scheduler_stats import make_scheduler_stats
from core_svc.structured_output import DEFAULT_STRUCTURED_OUTPUTS, StructuredOutputsConfig
from core_svc.structured_requests import StructuredRequests
from splitserve_contracts.output_types import (
    ErrorKind,
    ModelRunnerOutput,
    SchedulerStats,
    StepStatus,
)

logger = logging.getLogger(__name__)


class EngineCore:
    """Adds, aborts and steps requests of any number of clients.

    A request is known to its client by (client_id, client_handle) and to the workers by
    `req_handle`, which EngineCore assigns in arrival order. When an executor step fails and
    the engine `can_recover`, it suspends: it stops stepping and keeps every request (running
    ones go back to waiting, to be computed again) until `resume` gives it a new executor, or
    `fail` ends them. Without recovery, or once failed, the engine is failed for good: every
    request finishes with ERROR and later adds are refused the same way.

    With `async_scheduling` (SchedulerConfig) the scheduler is an AsyncScheduler, chosen here
    once, and a step runs ahead: `step` schedules and sends step N+1 before it waits for step
    N's output (a BatchQueue of the scheduler's `max_steps_in_flight`), and a fault loses both
    steps in flight (their requests are computed again after a recovery).
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        executor: Executor,
        can_recover: bool = False,
        structured_outputs_config: StructuredOutputsConfig = DEFAULT_STRUCTURED_OUTPUTS,
        wake: Callable[[], None] = lambda: None,
    ) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.executor = executor
        self.kv_cache_manager = KVCacheManager(
            num_blocks=cache_config.num_blocks,
            block_size=cache_config.block_size,
            max_model_len=scheduler_config.max_model_len,
            enable_caching=cache_config.enable_prefix_caching,
            sliding_window=cache_config.sliding_window,
        )
        scheduler_class = AsyncScheduler if scheduler_config.async_scheduling else Scheduler
        self.scheduler = scheduler_class(scheduler_config, cache_config, self.kv_cache_manager)
        self.structured = StructuredRequests(
            scheduler_config.vocab_size,
            structured_outputs_config,
            wake,
            scheduler_config.speculative_config,
            scheduler_config.max_model_len,
        )
        """Requests compiling their grammar, and the steps' grammar bitmasks; `wake` tells
        the busy loop a compile finished."""
        self.clients = ClientRequests()
        """Each client's live requests, and the outputs owed to clients between steps."""
        self.can_recover = can_recover
        self.is_failed = False
        self.failure_message = ""
        self.suspension: Fault | None = None
        """Set while the engine waits for its ranks to come back (suspended)."""
        self.can_step = True
        """Neither failed nor suspended (one flag for the busy loop's checks)."""
        self.is_draining = False
        """Set when the service is shutting down: new requests are refused, running ones
        finish."""
        self._next_req_handle = 1
        self.num_steps_applied = 0
        """Steps whose output was applied (with async scheduling, fewer than step() calls)."""
        self._batch_queue = self._new_batch_queue(executor)
        """Steps in flight, when the scheduler runs ahead (async scheduling)."""

    def _new_batch_queue(self, executor: Executor) -> BatchQueue | None:
        num_steps = self.scheduler.max_steps_in_flight
        return BatchQueue(executor, num_steps) if num_steps > 1 else None

    def add_request(self, request: Request) -> None:
        """Queue a request, or refuse it (finished with ERROR in the next step's outputs)."""
        request.req_handle = self._next_req_handle
        self._next_req_handle += 1
        request.resolve_max_tokens(self.scheduler_config.max_model_len)
        refusal = self._refusal(request)
        if refusal is not None:
            self._reject(request, *refusal)
            return
        if request.structured_output is not None:
            problem = self.structured.submit(request)
            if problem is not None:
                self._reject(request, ErrorKind.INVALID_REQUEST, problem)
                return
        self.clients.add(request)
        if request.structured_output is None:
            self.scheduler.add_request(request)

    def set_tokenizer(self, client_id: int, tokenizer_json: str, eos_token_ids: list[int]) -> None:
        """The client's tokenizer, which its constrained requests' grammars are compiled for."""
        self.structured.manager.set_tokenizer(client_id, tokenizer_json, eos_token_ids)

    def _admit_compiled(self) -> None:
        """Requests whose grammar compiled join the scheduler; refused ones end with an error."""
        ready, failed = self.structured.take_ready()
        for request in ready:
            self.scheduler.add_request(request)
        for request, problem in failed:
            self.clients.discard(request)
            self._reject(request, ErrorKind.INVALID_REQUEST, problem)

    def _finish_compiling(self, requests: list[Request], status: RequestStatus) -> list[Request]:
        """Finish those of `requests` still compiling (not in the scheduler); returns the
        others."""
        if not self.structured.compiling:
            return requests
        for request in self.structured.take_compiling(requests):
            request.finish(status)
        return [r for r in requests if not r.is_finished]

    def _refusal(self, request: Request) -> tuple[ErrorKind, str] | None:
        if self.is_failed:
            return ErrorKind.ENGINE_FAILURE, f"engine failed: {self.failure_message}"
        if self.is_draining:
            return ErrorKind.ENGINE_FAILURE, "the engine is shutting down; retry elsewhere"
        problem = invalid_request_reason(request, self.scheduler_config)
        if problem is None and self.clients.is_handle_in_use(request):
            problem = f"request handle {request.client_handle} is already in use by this client"
        if problem is None:
            problem = self._kv_capacity_problem(request)
        if problem is not None:
            return ErrorKind.INVALID_REQUEST, problem
        return self._overload_reason(request)

    def _kv_capacity_problem(self, request: Request) -> str | None:
        max_model_len, block_size = (
            self.scheduler_config.max_model_len,
            self.cache_config.block_size,
        )
        num_usable_blocks = self.kv_cache_manager.block_pool.num_usable_blocks
        return kv_capacity_problem(request, max_model_len, block_size, num_usable_blocks)

    def _overload_reason(self, request: Request) -> tuple[ErrorKind, str] | None:
        scheduler = self.scheduler
        num_kv_cache_tokens = (
            self.kv_cache_manager.block_pool.num_usable_blocks * self.cache_config.block_size
        )
        return overload_reason(
            request,
            self.scheduler_config,
            len(scheduler.waiting),
            scheduler.num_waiting_tokens,
            num_kv_cache_tokens,
        )

    def _reject(self, request: Request, kind: ErrorKind, error: str) -> None:
        log = logger.info if kind is ErrorKind.OVERLOADED else logger.warning
        log("refusing request %s: %s", request.request_id[:64], error)
        self.clients.refuse(request, kind, error)

    def abort_requests(self, client_id: int, client_handles: Iterable[int]) -> None:
        """Stop live requests of a client and free their blocks; unknown handles are no-ops.
        Aborted requests produce no further output, but the client gets the next step's
        scheduler stats (an empty EngineCoreOutputs), so its view of the queue and the KV cache
        does not stay at the pre-abort values."""
        requests = self.clients.abort(client_id, client_handles)
        scheduled = self._finish_compiling(requests, RequestStatus.FINISHED_ABORTED)
        self.scheduler.finish_requests(scheduled, RequestStatus.FINISHED_ABORTED)

    def abort_client(self, client_id: int) -> None:
        """Stop every live request of a client (its stream closed)."""
        live = self.clients.drop_client(client_id)
        self.kv_events.unsubscribe(client_id)
        self.structured.manager.forget_client(client_id)
        if live:
            aborted = self._finish_compiling(live, RequestStatus.FINISHED_ABORTED)
            self.scheduler.finish_requests(aborted, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_work(self) -> bool:
        """Whether step() has anything to do: requests to run, finished handles to tell
        the workers about, a step in flight, or outputs of refused requests to return."""
        return (
            bool(self.clients.pending)
            or self.structured.has_news
            or (self.can_step and (self._has_step_to_schedule() or bool(self._batch_queue)))
        )

    def _has_step_to_schedule(self) -> bool:
        scheduler = self.scheduler
        return scheduler.has_unfinished_requests() or scheduler.has_finished_requests()

    def step(self, before_update: Callable[[], None] | None = None) -> dict[int, EngineCoreOutputs]:
        """Schedule, execute and apply one step; returns the outputs per client_id.

        `before_update` runs after the executor returned and before the outputs are made:
        the busy loop applies aborts that arrived during the step there. With async
        scheduling, one call schedules and sends the next step, then applies the oldest step
        in flight once two are (or when there is nothing more to schedule, or when the step in
        flight computes prompt tokens and the prefill policy holds the next one back).
        """
        if self.structured.compiling:
            self._admit_compiled()
        outputs = self.clients.take_pending()
        if self.can_step:
            if self._batch_queue is not None:
                step_outputs = self._step_ahead(self._batch_queue, before_update)
            elif self._has_step_to_schedule():
                step_outputs = self._step_in_lockstep(before_update)
            else:
                step_outputs = {}
            self.clients.forget_finished(step_outputs)
            merge_outputs(outputs, step_outputs)
        return self.stamp(outputs)

    def _step_in_lockstep(
        self, before_update: Callable[[], None] | None
    ) -> dict[int, EngineCoreOutputs]:
        scheduler_output = self.scheduler.schedule()
        if self.scheduler.num_structured:
            self._fill_grammar(scheduler_output)
        try:
            model_runner_output = self.executor.execute_model(scheduler_output)
        except ExecutorError as exc:
            return self._on_step_error(exc, before_update)
        return self._apply_output(scheduler_output, model_runner_output, before_update)

    def _step_ahead(
        self, queue: BatchQueue, before_update: Callable[[], None] | None
    ) -> dict[int, EngineCoreOutputs]:
        deferred = None
        if queue and not self.scheduler.prefill_policy.may_schedule_ahead():
            pass  # the step in flight computes prompt tokens: the next one waits for it
        elif not queue.is_full and self._has_step_to_schedule():
            step = self.scheduler.schedule()
            if self.scheduler.num_structured and not self._fill_grammar(step):
                deferred = step  # its bitmask needs the older step's tokens
            try:
                queue.submit(step)
            except ExecutorError as exc:
                return self._on_step_error(exc, before_update)
            if not queue.is_full and deferred is None:
                return {}  # the next call schedules the step after it before waiting
        if not queue:
            return {}
        try:
            scheduler_output, model_runner_output = queue.collect()
        except ExecutorError as exc:
            return self._on_step_error(exc, before_update)
        outputs = self._apply_output(scheduler_output, model_runner_output, before_update)
        if deferred is not None and self.can_step:
            self._fill_grammar(deferred)
            try:
                queue.submit_grammar(deferred)
            except ExecutorError as exc:
                merge_outputs(outputs, self._on_step_error(exc, None))
        return outputs

    def _fill_grammar(self, step: SchedulerOutput) -> bool:
        """The step's grammar bitmask, when its requests' earlier tokens are all applied."""
        return self.structured.fill(step, self.scheduler.structured_rows(step.step_id))

    def _on_step_error(
        self, exc: ExecutorError, before_update: Callable[[], None] | None
    ) -> dict[int, EngineCoreOutputs]:
        if before_update is not None:
            before_update()
        error = str(exc) or type(exc).__name__
        return self.on_fault(Fault(exc.cause, f"executor failed: {error}"))

    def _apply_output(
        self,
        scheduler_output: SchedulerOutput,
        model_runner_output: ModelRunnerOutput,
        before_update: Callable[[], None] | None,
    ) -> dict[int, EngineCoreOutputs]:
        error = None
        if model_runner_output.status == StepStatus.ERROR:
            error = model_runner_output.error_message
        elif model_runner_output.step_id != scheduler_output.step_id:
            error = (
                f"got the output of step {model_runner_output.step_id} "
                f"for step {scheduler_output.step_id}"
            )
        if before_update is not None:
            before_update()
        if error is not None:
            return self.on_fault(Fault("rank_died", f"executor failed: {error}"))
        self.num_steps_applied += 1
        return self.scheduler.update_from_output(scheduler_output, model_runner_output)

    def _drop_steps_in_flight(self) -> None:
        if self._batch_queue is not None:
            self._batch_queue.clear()
        self.scheduler.drop_steps_in_flight()

    def stamp(self, outputs: dict[int, EngineCoreOutputs]) -> dict[int, EngineCoreOutputs]:
        """Give outputs the time, the step and the scheduler's state after it (step() does;
        outputs made between steps, e.g. requests failed on giving up, need it too)."""
        if outputs:
            stats = self.make_stats()
            now = time.monotonic()
            for engine_outputs in outputs.values():
                engine_outputs.timestamp = now
                engine_outputs.step_id = self.scheduler.step_id
                engine_outputs.scheduler_stats = stats
        return outputs

    def fail(self, message: str) -> dict[int, EngineCoreOutputs]:
        """Enter the failed state: every request finishes with ERROR and `message`."""
        logger.error("engine core failed: %s", message)
        self.is_failed = True
        self.can_step = False
        self.suspension = None
        self.failure_message = message
        self._drop_steps_in_flight()
        outputs = self._fail_all(message)
        self.clients.forget_finished(outputs)
        return outputs

    def _fail_all(self, message: str) -> dict[int, EngineCoreOutputs]:
        """Every request, compiling ones too, finishes with ERROR (engine failure)."""
        compiling = self.structured.take_compiling(list(self.structured.compiling.values()))
        for request in compiling:
            request.fail(ErrorKind.ENGINE_FAILURE, message)
        outputs = self.scheduler.fail_all(ErrorKind.ENGINE_FAILURE, message)
        merge_outputs(outputs, make_final_outputs(compiling))
        return outputs

    def on_fault(self, fault: Fault) -> dict[int, EngineCoreOutputs]:
        """The executor failed (a step, or a rank seen dying while idle): suspend when the
        engine can recover, else fail. Returns the outputs to send (none when suspended)."""
        if not self.can_step:
            return {}
        if not self.can_recover:
            return self.fail(fault.message)
        logger.error("engine core suspended (%s): %s", fault.cause, fault.message)
        self.suspension = fault
        self.can_step = False
        self._drop_steps_in_flight()  # lost with the ranks: computed again after resume
        self.scheduler.requeue_all()
        return {}

    @property
    def client_requests(self) -> dict[int, dict[int, Request]]:
        """client_id -> client_handle -> live request."""
        return self.clients.live

    @property
    def num_requests(self) -> int:
        """Requests running or waiting."""
        return len(self.scheduler.requests)

    def resume(self, executor: Executor, num_blocks: int) -> dict[int, EngineCoreOutputs]:
        """The ranks are back (brought up again, with `num_blocks` KV blocks): step on the new
        executor with a fresh KV cache. Requests that no longer fit a smaller cache fail;
        the others are scheduled again, the running ones by recompute."""
        self.executor = executor
        if self._batch_queue is not None:
            self._batch_queue = self._new_batch_queue(executor)
        self.kv_cache_manager.reset(num_blocks)
        self.suspension = None
        self.can_step = True
        too_big = [r for r in self.scheduler.requests.values() if self._kv_capacity_problem(r)]
        if not too_big:
            return {}
        message = "the KV cache shrank when the worker ranks came back; the request no longer fits"
        for request in too_big:
            request.error_kind, request.error_message = ErrorKind.ENGINE_FAILURE, message
        self.scheduler.finish_requests(too_big, RequestStatus.FINISHED_ERROR)
        outputs = make_final_outputs(too_big)
        self.clients.forget_finished(outputs)
        return outputs

    def abort_all(self, message: str) -> dict[int, EngineCoreOutputs]:
        """End every request with an error (shutdown); the engine itself stays usable."""
        outputs = self._fail_all(message)
        self.clients.forget_finished(outputs)
        return outputs

    def make_stats(self) -> SchedulerStats:
        return make_scheduler_stats(self.scheduler, self.kv_cache_manager, self.structured)

    def retire_lora(self, lora_id: int) -> int:
        """An adapter was unloaded (or replaced in place): the ranks drop it once no request
        runs it. Returns the requests that still do (compiling ones included)."""
        num_compiling = sum(
            r.lora is not None and r.lora.lora_id == lora_id
            for r in self.structured.compiling.values()
        )
        return num_compiling + self.scheduler.lora.retire(lora_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's reset_prefix_cache); refused (False) while any
        request holds KV blocks, steps in flight included."""
        return self.kv_cache_manager.reset_prefix_cache()

    @property
    def kv_events(self) -> KVEventRecorder:
        return self.kv_cache_manager.kv_events

    def subscribe_kv_events(self, client_id: int) -> list[KVEventBatch]:
        """Send the client the KV-cache events from now on; returns its snapshot of the cache
        (the caller hands the events recorded so far to the other subscribers first)."""
        cached = self.kv_cache_manager.block_pool.cached_block_hash_to_block
        return self.kv_events.subscribe(client_id, cached)

    def shutdown(self) -> None:
        self.structured.shutdown()
        self.executor.shutdown()

"""EngineCore: the scheduler, the KV-cache manager and an executor, stepped in lockstep
(vLLM's EngineCore). Single-threaded: EngineCoreProc drives it from one thread."""

from __future__ import annotations

from collections.abc import Iterable

from core_svc.engine.engine_core_steps import EngineCoreSteps
from core_svc.engine.request_checks import invalid_request_reason, kv_transfer_params_problem
from core_svc.kv_cache.kv_events import KVEventBatch, KVEventRecorder
from core_svc.request import Request, RequestStatus
from core_svc.sched.admission import overload_reason
from splitserve_contracts.output_types import ErrorKind


class EngineCore(EngineCoreSteps):
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

    Its parts are their own modules: its state and constructor (`EngineCoreState`,
    engine_core_state.py), the step (engine_core_steps.py), suspending, resuming and failing
    (engine_core_faults.py); this class is the requests' side: add, refuse, abort.
    """

    def add_request(self, request: Request) -> None:
        """Queue a request, or refuse it (finished with ERROR in the next step's outputs)."""
        request.req_handle = self._next_req_handle
        self._next_req_handle += 1
        request.resolve_max_tokens(self.scheduler_config.max_model_len)
        request.drop_unsampleable_stop_ids(self.scheduler_config.vocab_size)
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
        if problem is None:
            problem = kv_transfer_params_problem(request, self.kv_connector is not None)
        if problem is None and self.clients.is_handle_in_use(request):
            problem = f"request handle {request.client_handle} is already in use by this client"
        if problem is None:
            problem = self._kv_capacity_problem(request)
        if problem is not None:
            return ErrorKind.INVALID_REQUEST, problem
        return self._overload_reason(request)

    def _overload_reason(self, request: Request) -> tuple[ErrorKind, str] | None:
        scheduler = self.scheduler
        num_kv_cache_tokens = (
            self.kv_cache_manager.block_pool.num_usable_blocks * self.cache_config.cache.block_size
        )
        return overload_reason(
            request,
            self.scheduler_config,
            len(scheduler.waiting),
            scheduler.num_waiting_tokens,
            num_kv_cache_tokens,
        )

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

    @property
    def client_requests(self) -> dict[int, dict[int, Request]]:
        """client_id -> client_handle -> live request."""
        return self.clients.live

    @property
    def num_requests(self) -> int:
        """Requests running or waiting."""
        return len(self.scheduler.requests)

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

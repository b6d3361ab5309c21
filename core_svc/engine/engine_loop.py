"""EngineCoreProc: the engine core's busy loop on its own thread (vLLM's run_busy_loop).

Everyone else only puts commands in the loop's EngineInbox (core_svc/engine/engine_inbox.py); the loop
thread owns the EngineCore. Each iteration (1) takes every pending command, blocking on the
inbox when there is nothing to step (for at most the KV connector's poll interval while it has
transfers in progress: then the step is an empty one, for the ranks to report them), then (2)
runs one step and hands each client's outputs to `output_sink`. A rank restart
(core_svc/recovery.py) talks to the loop the same way: the executor's failure, the new executor
once the ranks are back, or giving up, are commands in the same order as the clients' adds and
aborts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from core_svc.engine.engine_core import EngineCore
from core_svc.engine.engine_inbox import CommandKind, EngineCommand, EngineInbox
from core_svc.executor.abstract import CanProfile, Fault
from core_svc.kv_cache.kv_events import KVEventBatch
from core_svc.outputs import EngineCoreOutputs
from core_svc.request import Request
from splitserve_contracts.output_types import SchedulerStats

logger = logging.getLogger(__name__)

OutputSink = Callable[[int, EngineCoreOutputs | KVEventBatch], None]
"""Receives (client_id, outputs or KV-cache events) on the loop thread; must not block for
long."""
StatsSink = Callable[[SchedulerStats, float | None], None]
"""Called on the loop thread after every iteration with the scheduler snapshot and the step's
duration in seconds (None when the iteration ran no step); feeds the metrics."""
SuspensionSink = Callable[[Fault, int], None]
"""Called once per suspension, on the loop thread, with the fault and the requests kept."""


class EngineCoreProc:
    """Runs an EngineCore on a thread, fed by `inbox` (whose methods are the thread-safe way
    to reach it)."""

    def __init__(
        self,
        engine_core: EngineCore,
        inbox: EngineInbox,
        output_sink: OutputSink,
        on_stats: StatsSink,
        on_failed: Callable[[str], None],
        on_suspended: SuspensionSink = lambda fault, num_requests: None,
        on_traced: Callable[[list[Request]], None] | None = None,
    ) -> None:
        self.engine_core = engine_core
        self._on_traced = on_traced
        """Takes the traced requests that finished (their spans are built off this thread)."""
        self.inbox = inbox
        self._output_sink = output_sink
        self._on_stats = on_stats
        self._on_failed = on_failed
        """Called once, on the loop thread, when the engine has failed and the failure's outputs
        went to their clients."""
        self._is_failure_reported = False
        self._on_suspended = on_suspended
        self._reported_suspension: Fault | None = None
        self._stats = engine_core.make_stats()
        self._thread = threading.Thread(target=self._run, name="engine-core-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def latest_stats(self) -> SchedulerStats:
        """Scheduler snapshot taken by the loop after its latest iteration."""
        return self._stats

    @property
    def is_idle(self) -> bool:
        """No request runs or waits, for its KV too (as of the loop's latest iteration)."""
        stats = self._stats
        return (
            stats.num_running_reqs == 0
            and stats.num_waiting_reqs == 0
            and stats.num_waiting_for_remote_kvs == 0
        )

    def stop(self, timeout: float | None = None) -> None:
        """Finish the current iteration, stop the loop and shut the executor down."""
        self.inbox.shutdown()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.engine_core.shutdown()

    def _run(self) -> None:
        while True:
            try:
                if not self._run_once():
                    return
            except Exception as exc:
                logger.exception("engine core loop error")
                try:
                    self._route(self.engine_core.fail(f"engine core loop error: {exc!r}"))
                    self._report_fault()
                except Exception:
                    logger.exception("engine core could not fail cleanly; the loop stops")
                    return

    def _run_once(self) -> bool:
        """One iteration; False once a shutdown command was met."""
        engine_core, connector = self.engine_core, self.engine_core.kv_connector
        is_busy = engine_core.has_work()
        polls = not is_busy and engine_core.polls_kv_connector()  # an empty step, after a while
        timeout = connector.poll_seconds() if polls and connector is not None else None
        for command in self.inbox.take(wait=not is_busy, timeout=timeout):
            if command.kind is CommandKind.SHUTDOWN:
                return False
            self._apply(command)
        step_seconds, stats = None, None
        if engine_core.has_work() or (polls and engine_core.polls_kv_connector()):
            started, num_applied = time.perf_counter(), engine_core.num_steps_applied
            outputs = engine_core.step(self._apply_step_aborts)
            if engine_core.num_steps_applied > num_applied:  # not a call that only sent a step
                step_seconds = time.perf_counter() - started
            self._send_kv_events(outputs)
            self._route(outputs)
            if not engine_core.can_step:
                self._report_fault()
            # step() already snapshotted the scheduler for its outputs; reuse it.
            stats = next((o.scheduler_stats for o in outputs.values()), None)
        else:
            self._send_kv_events({})  # what the commands did (a reset, a fresh cache)
        self._stats = stats or engine_core.make_stats()
        self._on_stats(self._stats, step_seconds)
        scheduler = engine_core.scheduler
        if scheduler.traced_finished:
            traced, scheduler.traced_finished = scheduler.traced_finished, []
            if self._on_traced is not None:
                self._on_traced(traced)
        return True

    def _apply(self, command: EngineCommand) -> None:
        engine_core = self.engine_core
        if command.kind is CommandKind.ADD:
            for request in command.requests:
                engine_core.add_request(request)
        elif command.kind is CommandKind.ABORT:
            engine_core.abort_requests(command.client_id, command.client_handles)
        elif command.kind is CommandKind.CLOSE_CLIENT:
            engine_core.abort_client(command.client_id)
        elif command.kind is CommandKind.TOKENIZER:
            engine_core.set_tokenizer(
                command.client_id, command.tokenizer_json, command.client_handles
            )
        elif command.kind is CommandKind.WAKE:
            pass
        elif command.kind is CommandKind.DRAIN:
            engine_core.is_draining = True
        elif command.kind is CommandKind.ABORT_ALL:
            message = "the engine is shutting down; retry elsewhere"
            self._route(engine_core.stamp(engine_core.abort_all(message)))
        elif command.kind is CommandKind.SUBSCRIBE_KV_EVENTS:
            self._send_kv_events({})  # what happened before the snapshot, to the others
            for batch in engine_core.subscribe_kv_events(command.client_id):
                self._output_sink(command.client_id, batch)
        elif command.kind is CommandKind.RETIRE_LORA:
            assert command.done is not None
            command.done.set_result(engine_core.retire_lora(command.lora_id))
        elif command.kind is CommandKind.PROFILE:
            assert command.done is not None
            executor = engine_core.executor
            if not isinstance(executor, CanProfile):
                command.done.set_result(1)
                return
            executor.send_profile(command.num_blocks, command.tokenizer_json)
            command.done.set_result(0)
        elif command.kind is CommandKind.RESET_PREFIX_CACHE:
            assert command.done is not None
            is_reset = engine_core.reset_prefix_cache()
            pool = engine_core.kv_cache_manager.block_pool
            command.done.set_result(0 if is_reset else pool.get_num_used_blocks())
        else:
            self._apply_recovery(command)

    def _apply_recovery(self, command: EngineCommand) -> None:
        engine_core = self.engine_core
        if command.kind is CommandKind.FAULT and command.executor is engine_core.executor:
            assert command.fault is not None
            self._route(engine_core.stamp(engine_core.on_fault(command.fault)))
        elif command.kind is CommandKind.RESUME:
            assert command.executor is not None and command.done is not None
            if engine_core.suspension is None:  # failed meanwhile (or never suspended)
                command.executor.shutdown()
                command.done.set_result(None)
                return
            num_requests = engine_core.num_requests
            self._route(engine_core.stamp(engine_core.resume(command.executor, command.num_blocks)))
            command.done.set_result(num_requests)
        elif command.kind is CommandKind.GIVE_UP and not engine_core.is_failed:
            assert command.fault is not None
            self._route(engine_core.stamp(engine_core.fail(command.fault.message)))
        self._report_fault()

    def _report_fault(self) -> None:
        """Tell the service once that the engine failed, or once per suspension."""
        engine_core = self.engine_core
        if engine_core.is_failed and not self._is_failure_reported:
            self._is_failure_reported = True
            self._on_failed(engine_core.failure_message)
        suspension = engine_core.suspension
        if suspension is not None and suspension is not self._reported_suspension:
            self._reported_suspension = suspension
            self._on_suspended(suspension, engine_core.num_requests)

    def _apply_step_aborts(self) -> None:
        for command in self.inbox.take_step_aborts():
            self._apply(command)

    def _send_kv_events(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        """Hand the events recorded so far to every subscriber: with its outputs of this step
        when it has some, else on their own."""
        kv_events = self.engine_core.kv_events
        if not kv_events.is_recording:
            return
        events = kv_events.take()
        if not events:
            return
        for client_id in kv_events.subscribers:
            engine_outputs = outputs.get(client_id)
            if engine_outputs is not None:
                engine_outputs.kv_events = events
            else:
                self._output_sink(client_id, KVEventBatch(events))

    def _route(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        for client_id, engine_outputs in outputs.items():
            try:
                self._output_sink(client_id, engine_outputs)
            except Exception:
                logger.exception("output sink failed for client %d", client_id)

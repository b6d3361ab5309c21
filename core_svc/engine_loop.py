"""EngineCoreProc: the engine core's busy loop on its own thread (vLLM's run_busy_loop).

Network handlers only enqueue commands; the loop thread owns the EngineCore. Each
iteration (1) drains every pending command, blocking on the queue when there is nothing
to step, then (2) runs one step and hands each client's outputs to `output_sink`. A rank
restart (core_svc/recovery.py) talks to the loop the same way: the executor's failure, the
new executor once the ranks are back, or giving up, are commands in the same order as the
clients' adds and aborts.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum

from core_svc.engine_core import EngineCore, Fault
from core_svc.executor import Executor, FaultCause
from core_svc.outputs import EngineCoreOutputs
from core_svc.request import Request
from splitserve_contracts.output_types import SchedulerStats

logger = logging.getLogger(__name__)

OutputSink = Callable[[int, EngineCoreOutputs], None]
"""Receives (client_id, outputs) on the loop thread; must not block for long."""
StatsSink = Callable[[SchedulerStats, float | None], None]
"""Called on the loop thread after every iteration with the scheduler snapshot and the step's
duration in seconds (None when the iteration ran no step); feeds the metrics."""


class CommandKind(Enum):
    ADD = 1
    ABORT = 2
    CLOSE_CLIENT = 3
    SHUTDOWN = 4
    DRAIN = 5
    """Refuse new requests from now on; running ones finish."""
    ABORT_ALL = 6
    """End every request with an error (the drain ran out of time)."""
    FAULT = 7
    """The executor failed outside a step (a rank seen dying while the engine was idle)."""
    RESUME = 8
    """The ranks are back: step on a new executor."""
    GIVE_UP = 9
    """The ranks did not come back in time: fail every request."""


@dataclass(slots=True)
class EngineCommand:
    """One input of the loop, in the order the network handlers enqueued it."""

    kind: CommandKind
    client_id: int = 0
    requests: list[Request] = field(default_factory=list)
    client_handles: list[int] = field(default_factory=list)
    executor: Executor | None = None
    fault: Fault | None = None
    num_blocks: int = 0
    done: Future[int] | None = None
    """RESUME: resolved with the number of requests resumed."""


class EngineCoreProc:
    """Runs an EngineCore on a thread; every public method is thread-safe.

    Aborts (and closed clients) also go to a side list under a lock. The lock makes
    "drain the queue, clear the side list" atomic, so whatever is on the side list when a
    step's executor call returns arrived during that step; the loop applies it before the
    step's outputs are made, and an aborted request emits nothing more. The same command,
    met again in the queue, is then a no-op.
    """

    def __init__(
        self,
        engine_core: EngineCore,
        output_sink: OutputSink,
        on_stats: StatsSink,
        on_failed: Callable[[str], None],
        input_queue: queue.Queue[EngineCommand] | None = None,
        on_suspended: Callable[[Fault], None] = lambda fault: None,
    ) -> None:
        self.engine_core = engine_core
        self._output_sink = output_sink
        self._on_stats = on_stats
        self._on_failed = on_failed
        """Called once, on the loop thread, when the engine has failed and the failure's outputs
        went to their clients."""
        self._is_failure_reported = False
        self._on_suspended = on_suspended
        """Called once per suspension, on the loop thread: the engine waits for its ranks."""
        self._reported_suspension: Fault | None = None
        self._input_queue: queue.Queue[EngineCommand] = input_queue or queue.Queue()
        self._lock = threading.Lock()
        self._step_aborts: list[EngineCommand] = []
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

    def add_requests(self, client_id: int, requests: list[Request]) -> None:
        self._input_queue.put(EngineCommand(CommandKind.ADD, client_id, requests=requests))

    def abort_requests(self, client_id: int, client_handles: Iterable[int]) -> None:
        command = EngineCommand(CommandKind.ABORT, client_id, client_handles=list(client_handles))
        self._put_abort(command)

    def close_client(self, client_id: int) -> None:
        """The client's stream closed: abort all of its requests."""
        self._put_abort(EngineCommand(CommandKind.CLOSE_CLIENT, client_id))

    def drain(self) -> None:
        """Refuse new requests; the running ones finish (see `is_idle`)."""
        self._put_abort(EngineCommand(CommandKind.DRAIN))

    def abort_all(self) -> None:
        """End every request now, with an error saying the engine is shutting down."""
        self._put_abort(EngineCommand(CommandKind.ABORT_ALL))

    def executor_failed(self, executor: Executor, message: str, cause: FaultCause) -> None:
        """`executor` failed (any thread); ignored unless it is still the engine's."""
        fault = Fault(cause, f"executor failed: {message}")
        self._input_queue.put(EngineCommand(CommandKind.FAULT, executor=executor, fault=fault))

    def resume(self, executor: Executor, num_blocks: int) -> Future[int]:
        """Step on `executor` (the ranks are back, with `num_blocks` KV blocks); the future
        gives the number of requests resumed."""
        done: Future[int] = Future()
        command = EngineCommand(CommandKind.RESUME, executor=executor, num_blocks=num_blocks)
        command.done = done
        self._input_queue.put(command)
        return done

    def give_up(self, message: str) -> None:
        """Fail every request with `message` (the ranks did not come back); the engine is
        failed from now on."""
        self._input_queue.put(EngineCommand(CommandKind.GIVE_UP, fault=Fault("rank_died", message)))

    @property
    def is_idle(self) -> bool:
        """No request runs or waits (as of the loop's latest iteration)."""
        stats = self._stats
        return stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0

    def stop(self, timeout: float | None = None) -> None:
        """Finish the current iteration, stop the loop and shut the executor down."""
        self._input_queue.put(EngineCommand(CommandKind.SHUTDOWN))
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.engine_core.shutdown()

    def _put_abort(self, command: EngineCommand) -> None:
        with self._lock:
            self._input_queue.put(command)
            self._step_aborts.append(command)

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
        engine_core = self.engine_core
        commands = [] if engine_core.has_work() else [self._input_queue.get()]
        with self._lock:
            while True:
                try:
                    commands.append(self._input_queue.get_nowait())
                except queue.Empty:
                    break
            self._step_aborts.clear()
        for command in commands:
            if command.kind is CommandKind.SHUTDOWN:
                return False
            self._apply(command)
        step_seconds, stats = None, None
        if engine_core.has_work():
            started, num_applied = time.perf_counter(), engine_core.num_steps_applied
            outputs = engine_core.step(self._apply_step_aborts)
            if engine_core.num_steps_applied > num_applied:  # not a call that only sent a step
                step_seconds = time.perf_counter() - started
            self._route(outputs)
            if not engine_core.can_step:
                self._report_fault()
            # step() already snapshotted the scheduler for its outputs; reuse it.
            stats = next((o.scheduler_stats for o in outputs.values()), None)
        self._stats = stats or engine_core.make_stats()
        self._on_stats(self._stats, step_seconds)
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
        elif command.kind is CommandKind.DRAIN:
            engine_core.is_draining = True
        elif command.kind is CommandKind.ABORT_ALL:
            message = "the engine is shutting down; retry elsewhere"
            self._route(engine_core.stamp(engine_core.abort_all(message)))
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
                command.done.set_result(0)
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
            self._on_suspended(suspension)

    def _apply_step_aborts(self) -> None:
        with self._lock:
            aborts, self._step_aborts = self._step_aborts, []
        for command in aborts:
            self._apply(command)

    def _route(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        for client_id, engine_outputs in outputs.items():
            try:
                self._output_sink(client_id, engine_outputs)
            except Exception:
                logger.exception("output sink failed for client %d", client_id)

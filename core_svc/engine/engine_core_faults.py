"""How the engine core meets a failed executor: it suspends (recovery on), keeping every request
until `resume` gives it a new executor, or fails for good, finishing them all with ERROR.

A suspended engine steps nothing; its running requests went back to waiting, to be computed
again by recompute once the ranks are back (core_svc/recovery.py brings them up).
"""

from __future__ import annotations

import logging

from core_svc.engine.engine_core_state import EngineCoreState
from core_svc.executor.abstract import Executor, Fault
from core_svc.outputs import EngineCoreOutputs
from core_svc.request import RequestStatus
from core_svc.sched.engine_outputs import make_final_outputs, merge_outputs
from splitserve_contracts.output_types import ErrorKind

logger = logging.getLogger(__name__)


class EngineCoreFaults(EngineCoreState):
    """The engine core's faults: suspend, resume, fail, and ending every request."""

    def _drop_steps_in_flight(self) -> None:
        if self._batch_queue is not None:
            self._batch_queue.clear()
        self.scheduler.drop_steps_in_flight()

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

"""One engine step: schedule, execute, apply the output (vLLM's EngineCore.step and
step_with_batch_queue).

In lockstep the step waits for its output before the next is built; with async scheduling
(a BatchQueue) the next step is sent first, and the oldest step in flight is applied once two
are. A step whose grammar bitmask needs an older step's tokens is sent without it, and the
bitmask follows once that step is applied. An executor error is a fault
(`engine_core_faults.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from core_svc.engine.batch_queue import BatchQueue
from core_svc.engine.engine_core_faults import EngineCoreFaults
from core_svc.executor.abstract import ExecutorError, Fault
from core_svc.outputs import EngineCoreOutputs
from core_svc.sched.engine_outputs import merge_outputs
from core_svc.sched.scheduler_output import SchedulerOutput
from splitserve_contracts.output_types import ErrorKind, ModelRunnerOutput, StepStatus


class EngineCoreSteps(EngineCoreFaults):
    """The engine core's step, and whether it has one to take."""

    def _admit_compiled(self) -> None:
        """Requests whose grammar compiled join the scheduler; refused ones end with an error."""
        ready, failed = self.structured.take_ready()
        for request in ready:
            self.scheduler.add_request(request)
        for request, problem in failed:
            self.clients.discard(request)
            self._reject(request, ErrorKind.INVALID_REQUEST, problem)

    def has_work(self) -> bool:
        """Whether step() has anything to do: requests to run, finished handles to tell
        the workers about, a step in flight, or outputs of refused requests to return (a KV
        connector's transfers alone are not: `polls_kv_connector`)."""
        return (
            bool(self.clients.pending)
            or self.structured.has_news
            or (self.can_step and (self._has_step_to_schedule() or bool(self._batch_queue)))
        )

    def _has_step_to_schedule(self) -> bool:
        scheduler = self.scheduler
        return scheduler.has_requests_to_step() or scheduler.has_finished_requests()

    def polls_kv_connector(self) -> bool:
        """Whether the KV connector has transfers in progress (or metadata to send): with
        nothing else to do, the loop sends an empty step every `kv_connector.poll_interval`
        so the ranks can report them."""
        connector = self.kv_connector
        return connector is not None and self.can_step and connector.has_pending()

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
            elif self._has_step_to_schedule() or self.polls_kv_connector():
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
        elif not queue.is_full and (
            self._has_step_to_schedule() or (not queue and self.polls_kv_connector())
        ):  # an empty step for the KV connector only when none is in flight
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

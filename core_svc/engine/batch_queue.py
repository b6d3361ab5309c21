"""BatchQueue: the steps sent to the executor whose outputs the engine has not taken yet
(vLLM's batch_queue, for --async-scheduling).

With a queue of two, the engine schedules and sends step N+1 before it waits for step N's
output, so its scheduling, the step's serialisation and the hop to the ranks overlap the
ranks' forward of step N. An executor that can pipeline (`PipelinedExecutor`: the gRPC one)
gets the step at once; any other runs it in `submit`, so the engine's scheduling-ahead logic is
the same whatever runs the model (the unit tests' fakes, for one).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from core_svc.executor.abstract import Executor, ExecutorError
from core_svc.sched.scheduler_output import SchedulerOutput
from splitserve_contracts.output_types import ModelRunnerOutput


@runtime_checkable
class PipelinedExecutor(Protocol):
    """An executor that takes a step without waiting for its output: `submit_model` sends it,
    `collect_model` waits for the oldest submitted step's output (both on the engine loop
    thread; steps run and answer in the order they were submitted)."""

    def submit_model(self, scheduler_output: SchedulerOutput) -> None: ...

    def collect_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def submit_grammar(self, scheduler_output: SchedulerOutput) -> None:
        """Send the grammar bitmask of a step submitted with has_pending_grammar."""
        ...


@dataclass(slots=True)
class _Submitted:
    scheduler_output: SchedulerOutput
    output: ModelRunnerOutput | None = None
    error: ExecutorError | None = None


class BatchQueue:
    """Steps in flight on one executor, oldest first; see the module docstring."""

    def __init__(self, executor: Executor, max_concurrent_batches: int = 2) -> None:
        self.executor = executor
        self.max_concurrent_batches = max_concurrent_batches
        self._steps: deque[_Submitted] = deque()
        self._error: ExecutorError | None = None
        """The failure of a step run in `submit`: an executor that failed stays failed."""

    def __len__(self) -> int:
        return len(self._steps)

    @property
    def is_full(self) -> bool:
        return len(self._steps) >= self.max_concurrent_batches

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Send a step; raises ExecutorError when the executor cannot take it."""
        submitted = _Submitted(scheduler_output)
        executor = self.executor
        if isinstance(executor, PipelinedExecutor):
            executor.submit_model(scheduler_output)
        elif not scheduler_output.has_pending_grammar:
            self._run(submitted)
        self._steps.append(submitted)

    def submit_grammar(self, scheduler_output: SchedulerOutput) -> None:
        """The grammar bitmask of the newest step, submitted with has_pending_grammar, is in
        it now: a pipelined executor sends it; any other runs the step now."""
        submitted = self._steps[-1]
        assert submitted.scheduler_output is scheduler_output
        if isinstance(self.executor, PipelinedExecutor):
            self.executor.submit_grammar(scheduler_output)
        else:
            scheduler_output.has_pending_grammar = False
            self._run(submitted)

    def _run(self, submitted: _Submitted) -> None:
        if self._error is not None:
            submitted.error = self._error
            return
        try:
            submitted.output = self.executor.execute_model(submitted.scheduler_output)
        except ExecutorError as exc:
            submitted.error = self._error = exc

    def collect(self) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        """Wait for the oldest step's output; raises ExecutorError when it failed."""
        submitted = self._steps.popleft()
        if submitted.error is not None:
            raise submitted.error
        if submitted.output is not None:
            return submitted.scheduler_output, submitted.output
        assert isinstance(self.executor, PipelinedExecutor)
        output = self.executor.collect_model(submitted.scheduler_output)
        return submitted.scheduler_output, output

    def clear(self) -> None:
        """Forget the steps in flight (their executor failed or was replaced)."""
        self._steps.clear()

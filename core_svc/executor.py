"""What the engine core needs from whatever runs the model (vLLM's Executor)."""

from __future__ import annotations

from typing import Protocol

from core_svc.outputs import ModelRunnerOutput
from core_svc.scheduler_output import SchedulerOutput


class ExecutorError(Exception):
    """A step could not be run or its result is unusable; the engine stops serving."""


class Executor(Protocol):
    """Runs engine steps on the worker ranks.

    `execute_model` sends one SchedulerOutput to every rank and returns the output rank's
    ModelRunnerOutput for it; it raises ExecutorError (or returns an output whose
    `error_message` is set) when a rank failed. It is called from the engine loop thread
    only, one step at a time.
    """

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...

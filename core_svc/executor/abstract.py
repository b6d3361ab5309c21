"""What the engine core needs from whatever runs the model (vLLM's Executor)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from core_svc.sched.scheduler_output import SchedulerOutput
from splitserve_contracts.output_types import ModelRunnerOutput

FaultCause = Literal["rank_died", "rank_hung"]
"""Why the ranks stopped serving: a rank died, broke its stream or failed a step (rank_died),
or a step outlived its timeout (rank_hung). The label `cause` of the recovery metrics."""
FAULT_CAUSES: tuple[FaultCause, ...] = ("rank_died", "rank_hung")


@dataclass(frozen=True, slots=True)
class Fault:
    """Why the engine stopped stepping: the executor's failure."""

    cause: FaultCause
    message: str


class ExecutorError(Exception):
    """A step could not be run or its result is unusable: the ranks must be brought up again
    (or, without recovery, the engine stops serving)."""

    def __init__(self, message: str, cause: FaultCause = "rank_died") -> None:
        super().__init__(message)
        self.cause: FaultCause = cause


class Executor(Protocol):
    """Runs engine steps on the worker ranks.

    `execute_model` sends one SchedulerOutput to every rank and returns the output rank's
    ModelRunnerOutput for it; it raises ExecutorError (or returns an output whose
    `error_message` is set) when a rank failed. It is called from the engine loop thread
    only, one step at a time.
    """

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...


@runtime_checkable
class CanProfile(Protocol):
    """An executor whose ranks can run the torch profiler (vLLM's start/stop_profile)."""

    def send_profile(self, action: int, prefix: str) -> None:
        """Start (1) or stop (2) every rank's profiler after the steps already sent."""
        ...

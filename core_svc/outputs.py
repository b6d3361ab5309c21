"""What the engine core produces (EngineCoreOutputs, SchedulerStats) and what a step returns
from the workers (ModelRunnerOutput), as plain dataclasses mirroring the protos."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from core_svc.kv_events import KVCacheEvent


class FinishReason(IntEnum):
    """Why a request stopped; values match common.v1.FinishReason."""

    STOP = 1
    LENGTH = 2
    ABORT = 3
    ERROR = 4


class ErrorKind(IntEnum):
    """Why a request ended with ERROR; values match core.v1.ErrorKind."""

    UNSPECIFIED = 0
    INVALID_REQUEST = 1
    OVERLOADED = 2
    ENGINE_FAILURE = 3


class EngineCoreEventType(IntEnum):
    """A step of a request's engine-side lifecycle; values match core.v1.EngineCoreEventType."""

    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


@dataclass(slots=True)
class EngineCoreEvent:
    """One lifecycle event, stamped with the engine core's time.monotonic()."""

    type: EngineCoreEventType
    timestamp: float


@dataclass(slots=True)
class LogprobsTable:
    """Columnar log-probabilities: per position the chosen token, then the top ones."""

    num_top_logprobs: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)


@dataclass(slots=True)
class EngineCoreOutput:
    """One request's details for one step beyond its new token ids."""

    request_handle: int
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    new_logprobs: LogprobsTable | None = None
    prompt_logprobs: LogprobsTable | None = None
    events: list[EngineCoreEvent] = field(default_factory=list)
    num_cached_tokens: int | None = None
    error_message: str = ""
    error_kind: ErrorKind = ErrorKind.UNSPECIFIED


@dataclass(slots=True)
class SchedulerStats:
    """Snapshot of the scheduler; counters are cumulative since the engine started."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    step_id: int = 0
    num_scheduled_tokens: int = 0
    num_used_blocks: int = 0
    num_total_blocks: int = 0
    num_prompt_tokens: int = 0
    """Cumulative: prompts whose first token was sampled (see Scheduler.num_prompt_tokens)."""
    num_generation_tokens: int = 0
    """Cumulative: tokens sampled."""
    encoder_cache_queries: int = 0
    encoder_cache_hits: int = 0
    num_waiting_tokens: int = 0
    """Tokens of the waiting requests (prefix-cache hits not subtracted)."""


@dataclass(slots=True)
class EngineCoreOutputs:
    """One step's results for one client, columnar: request_handles[i] (the client's own
    handle) gained num_new_tokens[i] tokens, the next entries of new_token_ids."""

    request_handles: list[int] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    new_token_ids: list[int] = field(default_factory=list)
    details: list[EngineCoreOutput] = field(default_factory=list)
    timestamp: float = 0.0
    step_id: int = 0
    scheduler_stats: SchedulerStats | None = None
    kv_events: list[KVCacheEvent] | None = None
    """The prefix cache's changes up to and during this step, for a client that subscribed."""

    def merge(self, other: EngineCoreOutputs) -> None:
        """Append `other`'s columns and details (used when rejected requests share a step)."""
        self.request_handles.extend(other.request_handles)
        self.num_new_tokens.extend(other.num_new_tokens)
        self.new_token_ids.extend(other.new_token_ids)
        self.details.extend(other.details)


@dataclass(slots=True)
class StepTimings:
    """Where a worker rank's step time went, in seconds on the rank's clock."""

    prepare_inputs_seconds: float = 0.0
    forward_seconds: float = 0.0
    sample_seconds: float = 0.0
    total_seconds: float = 0.0


@dataclass(slots=True)
class ModelRunnerOutput:
    """One step's result from the output rank. `error_message` is set (not None) when the
    rank reported STEP_STATUS_ERROR; the engine then fails instead of reading the tokens."""

    step_id: int
    req_handles: list[int] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: dict[int, LogprobsTable] = field(default_factory=dict)
    prompt_logprobs: dict[int, LogprobsTable] = field(default_factory=dict)
    error_message: str | None = None
    rank: int = 0
    timings: StepTimings | None = None
    num_used_kv_blocks: int = 0
    failed_reqs: dict[int, str] = field(default_factory=dict)
    """Requests the ranks refused for their own invalid data, with the reason; the rest of
    the step ran."""

"""The frontend's view of what the engine core says: its facts and its per-step outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

EVENT_QUEUED = 1
EVENT_SCHEDULED = 2
EVENT_PREEMPTED = 3
ERROR_KIND_INVALID_REQUEST = 1
ERROR_KIND_OVERLOADED = 2
"""core.v1.ErrorKind values the frontend tells apart (others: the engine failed)."""


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """The engine's facts from the core's Handshake."""

    served_model_name: str
    model_path: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    dtype: str
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    engine_id: str
    max_concurrency: float
    max_tokens_per_mm_item: int = 0
    """Placeholder tokens one image takes in the workers' model; 0: the model takes text only."""


@dataclass(slots=True)
class LogprobsTable:
    """Columnar log-probabilities: per position the chosen token, then num_top alternatives."""

    num_top: int
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]

    @property
    def num_positions(self) -> int:
        return len(self.ranks)


@dataclass(slots=True)
class CoreOutputDetail:
    """One request's step details beyond its new tokens."""

    handle: int
    finish_reason: int = 0
    stop_token_id: int | None = None
    new_logprobs: LogprobsTable | None = None
    prompt_logprobs: LogprobsTable | None = None
    events: list[tuple[int, float]] = field(default_factory=list)
    num_cached_tokens: int | None = None
    error_message: str = ""
    error_kind: int = 0


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """The engine core's scheduler after a step (core.v1 SchedulerStats): what its queue and KV
    cache hold. Counters are cumulative since the engine started."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    step_id: int = 0


@dataclass(slots=True)
class CoreOutputs:
    """One engine step's outputs for this frontend, columnar like the wire message."""

    handles: list[int]
    num_new_tokens: list[int]
    new_token_ids: list[int]
    details: dict[int, CoreOutputDetail]
    timestamp: float
    step_id: int
    scheduler_stats: SchedulerStats | None = None

"""The frontend's view of what the engine core says: its facts and its per-step outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve_contracts.engine_options_types import EngineOptions
from splitserve_contracts.output_types import (
    EngineCoreEvent,
    ErrorKind,
    FinishReason,
    LogprobsTable,
    PoolerConfig,
    SchedulerStats,
)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """The engine's facts from the core's Handshake: what it measured or resolved at start-up,
    and its options (the generated record: `info.options.cache.block_size`, ...)."""

    served_model_name: str
    max_model_len: int
    """The resolved options.model.max_model_len (the model's own when that is 0)."""
    vocab_size: int
    num_kv_blocks: int
    dtype: str
    """The workers' compute dtype, resolved ("bfloat16", never "auto")."""
    enable_prefix_caching: bool
    engine_id: str
    max_concurrency: float
    options: EngineOptions = field(default_factory=EngineOptions)
    max_tokens_per_mm_item: int = 0
    """Placeholder tokens one image takes in the workers' model; 0: the model takes text only."""
    pooler_config: PoolerConfig | None = None
    """How the model pools when the engine serves a pooling model (--runner pooling): it then
    takes embedding requests only; None: a generative model."""


@dataclass(frozen=True, slots=True)
class LoraAdapterInfo:
    """A LoRA adapter the engine serves (core.v1.LoraAdapter)."""

    name: str
    path: str
    base_model_name: str
    max_rank: int


@dataclass(frozen=True, slots=True)
class HistogramState:
    """A Prometheus histogram as the engine core counts it: cumulative bucket counts."""

    upper_bounds: list[float]
    cumulative_counts: list[int]
    """One per bound, then the +Inf bucket (every observation)."""
    sum: float


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The core's scheduler state and its per-step token histogram (GetSchedulerStats)."""

    stats: SchedulerStats
    iteration_tokens: HistogramState | None = None


@dataclass(slots=True)
class CoreOutputDetail:
    """One request's step details beyond its new tokens."""

    handle: int
    finish_reason: FinishReason = FinishReason.UNSPECIFIED
    stop_token_id: int | None = None
    new_logprobs: LogprobsTable | None = None
    prompt_logprobs: LogprobsTable | None = None
    events: list[EngineCoreEvent] = field(default_factory=list)
    num_cached_tokens: int | None = None
    error_message: str = ""
    error_kind: ErrorKind = ErrorKind.UNSPECIFIED
    pooling_output: bytes = b""
    """A pooling request's vector (float32 little-endian), with its finish."""
    kv_transfer_params_json: str = ""
    """A KV producer's handoff (a JSON object), with its finish."""


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


@dataclass(frozen=True, slots=True)
class TokenizerInfo:
    """The tokenizer as the engine core's grammar matchers need it (core.v1.TokenizerInfo):
    its tokenizer.json (added tokens included) and the ids that end a sequence."""

    tokenizer_json: str
    eos_token_ids: tuple[int, ...]

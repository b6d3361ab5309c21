"""What the engine core produces for its clients: one step's EngineCoreOutputs per client. The
records and enums it shares with the other services (SchedulerStats, LogprobsTable,
ModelRunnerOutput, FinishReason, ...) are generated from the contract:
splitserve_contracts/output_types.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from core_svc.kv_cache.kv_events import KVCacheEvent
from splitserve_contracts.output_types import (
    EngineCoreEvent,
    ErrorKind,
    FinishReason,
    LogprobsTable,
    SchedulerStats,
)


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
    pooling_output: bytes = b""
    """A pooling request's pooled vector, with its finish."""
    kv_transfer_params_json: str = ""
    """A KV producer's handoff (vLLM's kv_transfer_params, a JSON object), with its finish."""


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

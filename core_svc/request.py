"""A request's state inside the engine core."""

from __future__ import annotations

import time
from enum import IntEnum

from core_svc.outputs import EngineCoreEvent, EngineCoreEventType, FinishReason
from core_svc.sampling import SamplingParams


class RequestStatus(IntEnum):
    """Lifecycle of a request; every status after PREEMPTED is final."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}
_FIRST_FINISHED = RequestStatus.FINISHED_STOPPED


class Request:
    """One generation request (vLLM's `Request`).

    Invariants: `all_token_ids == prompt_token_ids + output_token_ids` (both lists grow in
    place); `num_computed_tokens <= num_tokens`; `block_hashes[i]` is the chained hash of
    full block i of `all_token_ids` (empty when prefix caching is off). `req_handle` is
    assigned by EngineCore when the request is added (-1 before).
    """

    __slots__ = (
        "req_handle",
        "client_id",
        "client_handle",
        "request_id",
        "prompt_token_ids",
        "output_token_ids",
        "all_token_ids",
        "num_prompt_tokens",
        "sampling_params",
        "eos_token_id",
        "cache_salt",
        "priority",
        "arrival_time",
        "status",
        "num_computed_tokens",
        "num_cached_tokens",
        "num_preemptions",
        "block_hashes",
        "stop_reason",
        "events",
        "max_tokens",
        "min_tokens",
        "stop_token_ids",
        "all_stop_token_ids",
        "error_message",
        "num_sent_token_ids",
        "is_known_to_workers",
    )

    def __init__(
        self,
        client_id: int,
        client_handle: int,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        cache_salt: str = "",
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        self.req_handle = -1
        self.client_id = client_id
        self.client_handle = client_handle
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.cache_salt = cache_salt
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        """Prompt tokens served from the prefix cache at first admission; -1 before."""
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []
        self.stop_reason: int | None = None
        self.events: list[EngineCoreEvent] = []
        self.max_tokens = -1 if sampling_params.max_tokens is None else sampling_params.max_tokens
        """Output tokens allowed; resolved by `resolve_max_tokens` when the request is added."""
        self.min_tokens = sampling_params.min_tokens
        self.stop_token_ids = sampling_params.all_stop_token_ids(eos_token_id)
        """Sent to workers: the sampler masks them until min_tokens outputs exist."""
        self.all_stop_token_ids = frozenset(self.stop_token_ids)
        self.error_message = ""
        self.num_sent_token_ids = 0
        """Token ids (prompt and outputs) the workers already have."""
        self.is_known_to_workers = False

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status >= _FIRST_FINISHED

    def resolve_max_tokens(self, max_model_len: int) -> None:
        """max_tokens capped by the room left in max_model_len (unset: all of that room), so
        `num_output_tokens >= max_tokens` is the one length check the hot path needs."""
        room = max_model_len - self.num_prompt_tokens
        max_tokens = self.sampling_params.max_tokens
        self.max_tokens = room if max_tokens is None else min(max_tokens, room)

    def record_event(self, event_type: EngineCoreEventType, timestamp: float | None = None) -> None:
        self.events.append(
            EngineCoreEvent(event_type, time.monotonic() if timestamp is None else timestamp)
        )

    def take_events(self) -> list[EngineCoreEvent]:
        events, self.events = self.events, []
        return events

    def __repr__(self) -> str:
        return (
            f"Request(handle={self.req_handle}, client={self.client_id}/{self.client_handle}, "
            f"status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )

"""A request's state inside the engine core."""

from __future__ import annotations

import time
from enum import IntEnum
from typing import TYPE_CHECKING, Any

from core_svc.lora import LoraRequest
from core_svc.mm_inputs import MultiModalFeatureSpec
from core_svc.request_trace import RequestTrace
from splitserve_contracts.output_types import (
    EngineCoreEvent,
    EngineCoreEventType,
    ErrorKind,
    FinishReason,
)

if TYPE_CHECKING:
    from core_svc.structured_output.grammar_state import StructuredOutputRequest


class RequestStatus(IntEnum):
    """Lifecycle of a request; the FINISHED_* statuses are final (`Request.finish`)."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6
    WAITING_FOR_REMOTE_KVS = 7
    """Its blocks are allocated and a KV connector loads its prompt from a peer; it is in
    neither the waiting queue nor the running set (core_svc/sched/kv_transfers.py)."""

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """One generation request (vLLM's `Request`).

    Invariants: `all_token_ids == prompt_token_ids + output_token_ids` (both lists grow in
    place); `num_computed_tokens <= num_tokens`; `block_hashes[i]` is the chained hash of
    full block i of `all_token_ids` (empty when prefix caching is off). `req_handle` is
    assigned by EngineCore when the request is added (-1 before).

    The core reads only the stop conditions (max_tokens, min_tokens, stop_token_ids,
    eos_token_id); `sampler_params` is the serialized common.v1.SamplerParams the frontend
    built, passed to the workers untouched.
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
        "sampler_params",
        "skip_reading_prefix_cache",
        "eos_token_id",
        "cache_salt",
        "priority",
        "arrival_time",
        "status",
        "is_finished",
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
        "error_kind",
        "num_sent_token_ids",
        "num_output_placeholders",
        "is_known_to_workers",
        "mm_features",
        "structured_output",
        "is_resumed",
        "lora",
        "holds_lora_slot",
        "trace",
        "pooling_task",
        "pooling_output",
        "kv_transfer_params",
        "kv_transfer_params_problem",
        "kv_load_failed",
    )

    def __init__(
        self,
        client_id: int,
        client_handle: int,
        request_id: str,
        prompt_token_ids: list[int],
        *,
        max_tokens: int,
        output_token_ids: list[int] | None = None,
        min_tokens: int = 0,
        stop_token_ids: tuple[int, ...] = (),
        eos_token_id: int | None = None,
        sampler_params: bytes = b"",
        skip_reading_prefix_cache: bool = False,
        cache_salt: str = "",
        priority: int = 0,
        arrival_time: float | None = None,
        mm_features: tuple[MultiModalFeatureSpec, ...] = (),
        structured_output: StructuredOutputRequest | None = None,
        is_resumed: bool = False,
        lora: LoraRequest | None = None,
        trace: RequestTrace | None = None,
        pooling_task: str = "",
        kv_transfer_params: dict[str, Any] | None = None,
        kv_transfer_params_problem: str = "",
    ) -> None:
        self._init_engine_state()
        self.kv_transfer_params = kv_transfer_params
        """vLLM's kv_transfer_params (a KV connector's, None: none): as the client sent them
        (a consumer's handoff, a producer's do_remote_decode); once the request finished on an
        engine with a connector, what the connector returned for its final output (a producer's
        handoff)."""
        self.kv_transfer_params_problem = kv_transfer_params_problem
        """Why the client's kv_transfer_params_json is no JSON object ("" when it is); the
        request is refused."""
        self.pooling_task = pooling_task
        """A pooling request's task ("embed"); "" for a generation request. A pooling
        request computes its prompt (never read from the prefix cache: every position is
        pooled), samples nothing and finishes with `pooling_output`."""
        self.trace = trace
        """Its trace (--otlp-traces-endpoint and a frontend that traces it); None: untraced."""
        self.client_id = client_id
        self.client_handle = client_handle
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = list(output_token_ids or ())
        """Outputs so far; a request a frontend resubmitted (its engine core restarted)
        arrives with the ones it already had."""
        self.is_resumed = is_resumed
        """A frontend resubmitted it (EngineCoreRequest.resumed): an engine core admitted it
        before, so the queue limits give it room (within a bound: EngineCore)."""
        self.all_token_ids = [*prompt_token_ids, *self.output_token_ids]
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampler_params = sampler_params
        self.skip_reading_prefix_cache = skip_reading_prefix_cache or bool(pooling_task)
        """Prompt logprobs and pooling need every prompt position computed, so such requests
        never hit."""
        self.eos_token_id = eos_token_id
        self.cache_salt = cache_salt
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.max_tokens = max_tokens
        """Output tokens allowed; capped by `resolve_max_tokens` when the request is added."""
        self.min_tokens = min_tokens
        self.stop_token_ids = stop_token_ids
        """Token ids besides EOS that end the request, reported as its stop_reason."""
        self.all_stop_token_ids = frozenset(
            stop_token_ids if eos_token_id is None else (*stop_token_ids, eos_token_id)
        )
        """Every id that may end the request; the workers' sampler masks them under
        min_tokens."""
        self.mm_features = mm_features
        """The prompt's images (placeholder ranges, hashes, serialized encoder inputs), kept
        until the request finishes: a recompute may run the encoder again."""
        self.structured_output = structured_output
        """Its grammar state when its output is constrained (structured outputs), else None."""
        self.lora = lora
        """The LoRA adapter it runs with (None: the base model; lora_id 0: a name that is not
        loaded, refused when it is added)."""

    def _init_engine_state(self) -> None:
        """What the engine tracks of the request, as it starts (nothing the client sent):
        its handle, status and progress, its errors, what the workers have."""
        self.req_handle = -1
        self.kv_load_failed = False
        """A KV connector's load failed: computed here, never offered to the connector again."""
        self.pooling_output = b""
        """The pooled vector the output rank sent (float32 little-endian), once it ran."""
        self.status = RequestStatus.WAITING
        self.is_finished = False
        """Whether the status is final; set by `finish` only (a plain attribute: the hot loops
        read it for every request every step)."""
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        """Prompt tokens served from the prefix cache at first admission; -1 before."""
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []
        self.stop_reason: int | None = None
        self.events: list[EngineCoreEvent] = []
        self.error_message = ""
        self.error_kind = ErrorKind.UNSPECIFIED
        self.num_sent_token_ids = 0
        """Token ids (prompt and outputs) the workers already have."""
        self.num_output_placeholders = 0
        """Async scheduling: tokens scheduled to be sampled by steps still in flight (vLLM's
        num_output_placeholders); the workers feed each one to the next step themselves."""
        self.is_known_to_workers = False
        self.holds_lora_slot = False
        """Whether it counts as a running request of its adapter (core_svc/sched/lora_slots.py)."""

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def lora_name(self) -> str:
        """Its LoRA adapter's name ("" for the base model)."""
        return "" if self.lora is None else self.lora.name

    @property
    def lora_hash_key(self) -> bytes:
        """What its LoRA adapter adds to every block hash (b"" for the base model)."""
        return b"" if self.lora is None else self.lora.hash_key

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def finish(self, status: RequestStatus) -> None:
        """Enter a final status (FINISHED_*)."""
        if status.finish_reason is None:
            raise ValueError(f"{status.name} is not a final status")
        self.status = status
        self.is_finished = True

    def fail(self, kind: ErrorKind, message: str) -> None:
        """Finish with ERROR, saying why."""
        self.error_kind, self.error_message = kind, message
        self.finish(RequestStatus.FINISHED_ERROR)

    def resolve_max_tokens(self, max_model_len: int) -> None:
        """max_tokens capped by the room left in max_model_len, so `num_output_tokens >=
        max_tokens` is the one length check the hot path needs."""
        self.max_tokens = min(self.max_tokens, max_model_len - self.num_prompt_tokens)

    def drop_unsampleable_stop_ids(self, vocab_size: int) -> None:
        """Forget the EOS and stop token ids at or past `vocab_size`: the model never samples
        them, so they can never end the request (in vLLM such an id never matches), and the
        workers index logits by these ids (min_tokens masks them). A tokenizer's added tokens
        can lie past the embedding rows (Qwen2Tokenizer's `<|endoftext|>`); a client's own
        stop_token_ids past the vocabulary are refused by the frontend, as vLLM's are."""
        if self.eos_token_id is not None and self.eos_token_id >= vocab_size:
            self.eos_token_id = None
        if any(token_id >= vocab_size for token_id in self.stop_token_ids):
            self.stop_token_ids = tuple(i for i in self.stop_token_ids if i < vocab_size)
        self.all_stop_token_ids = frozenset(i for i in self.all_stop_token_ids if i < vocab_size)

    def record_event(self, event_type: EngineCoreEventType, timestamp: float | None = None) -> None:
        now = time.monotonic() if timestamp is None else timestamp
        self.events.append(EngineCoreEvent(event_type, now))
        if self.trace is not None:
            self.trace.events.append((event_type, now))

    def take_events(self) -> list[EngineCoreEvent]:
        events, self.events = self.events, []
        return events

    def __repr__(self) -> str:
        return (
            f"Request(handle={self.req_handle}, client={self.client_id}/{self.client_handle}, "
            f"status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )

"""The worker's own view of one engine step (the protobuf SchedulerOutput, decoded once).

Only `convert.py` turns protobuf into these types; the model runner, input batch and sampler
see nothing else. Repeated integer fields stay columnar as numpy arrays, so a step with many
requests costs a few array copies rather than per-token Python objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from splitserve_contracts.sampling_types import SamplerParams
from splitserve_runtime.tracing import TraceContext

IntArray = npt.NDArray[np.int64]


def _empty() -> IntArray:
    return np.zeros(0, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class MultiModalInput:
    """One image of a request: its placeholder tokens [offset, offset + length) of the prompt,
    its content hash and its encoder input (raw tensor bytes, checked by the rank)."""

    identifier: str
    offset: int
    length: int
    data: bytes
    shape: tuple[int, ...]
    dtype: str
    grid_thw: tuple[int, ...] = ()
    """The patch grid (temporal, height, width) of a dynamic-resolution image; empty: none."""

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """A request the ranks see for the first time.

    Invariant: `num_computed_tokens` tokens of the prompt (and then of `output_token_ids`)
    already have KV in `block_ids` (a prefix-cache hit); the step computes from that position
    on. `output_token_ids` are outputs generated before the request reached these ranks (it
    resumed after a rank or engine-core restart).
    """

    req_handle: int
    request_id: str
    prompt_token_ids: IntArray
    sampling: SamplerParams
    block_ids: IntArray
    num_computed_tokens: int = 0
    stop_token_ids: IntArray = field(default_factory=_empty)
    min_tokens: int = 0
    mm_features: tuple[MultiModalInput, ...] = ()
    output_token_ids: IntArray = field(default_factory=_empty)
    lora_id: int = 0
    """The LoRA adapter it runs with (0: the base model)."""
    trace: TraceContext | None = None
    """The engine core's span of the request (worker_svc/stream/step_tracing.py); None: untraced."""
    pooling_task: str = ""
    """A pooling request's task: pooled over its prompt, never sampled ("": a generation
    request)."""
    state_slot: int = 0
    """Its state slot (a model with state layers: zeroed before its first step; 0: none)."""


@dataclass(frozen=True, slots=True)
class CachedRequestData:
    """Already-known requests scheduled again, column by column.

    Entry i of every per-request column belongs to `req_handles[i]`; the flat columns
    (`new_block_ids`, `new_token_ids`, `resumed_all_token_ids`) are cut by their `num_*`
    companions. Resumed requests (a subset of `req_handles`) replace their block list with
    their new block ids and rebuild their tokens from `resumed_all_token_ids`.
    """

    req_handles: IntArray = field(default_factory=_empty)
    num_computed_tokens: IntArray = field(default_factory=_empty)
    num_new_block_ids: IntArray = field(default_factory=_empty)
    new_block_ids: IntArray = field(default_factory=_empty)
    num_new_token_ids: IntArray = field(default_factory=_empty)
    new_token_ids: IntArray = field(default_factory=_empty)
    resumed_req_handles: IntArray = field(default_factory=_empty)
    num_resumed_token_ids: IntArray = field(default_factory=_empty)
    resumed_all_token_ids: IntArray = field(default_factory=_empty)
    resumed_state_slots: IntArray = field(default_factory=_empty)
    """The state slot of each resumed request (a model with state layers; else empty)."""

    @property
    def num_reqs(self) -> int:
        return len(self.req_handles)


@dataclass(frozen=True, slots=True)
class GrammarBitmask:
    """Masks of a step's constrained requests: row i (ceil(vocab / 32) int32 words; bit b of
    word w allows token 32 * w + b) belongs to req_handles[i]."""

    req_handles: IntArray
    bitmask: npt.NDArray[np.int32]
    all_allowed: npt.NDArray[np.bool_] | None = None
    """Per row, whether it allows every token (known from the sparse wire form; None when
    not known): such rows are not applied."""


@dataclass(frozen=True, slots=True)
class LoraSlots:
    """A step's LoRA slot changes: adapter lora_ids[i] (its folder paths[i], read when the rank
    does not hold it) now sits in slots[i]; id 0 empties the slot."""

    slots: tuple[int, ...]
    lora_ids: tuple[int, ...]
    paths: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One engine step, identical on every rank.

    `num_scheduled_tokens` has one entry per scheduled request: first the new requests, then
    the cached ones, in that order; this is also the order of the step's outputs.
    """

    step_id: int
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: IntArray = field(default_factory=_empty)
    total_num_scheduled_tokens: int = 0
    finished_req_handles: IntArray = field(default_factory=_empty)
    scheduled_encoder_inputs: dict[int, list[int]] = field(default_factory=dict)
    """Request handle -> indices of its mm_features whose encoder runs this step."""
    free_encoder_mm_hashes: tuple[str, ...] = ()
    """Encoder cache entries to drop before the step."""
    grammar_bitmask: GrammarBitmask | None = None
    """Token masks of the constrained requests that sample (structured outputs)."""
    has_pending_grammar: bool = False
    """The masks follow in a message of their own, before sampling (async scheduling)."""
    lora_slots: LoraSlots | None = None
    """LoRA slots that changed since the previous step (None: none did)."""
    free_lora_ids: tuple[int, ...] = ()
    """LoRA adapters no request uses any more: ranks drop them."""
    num_spec_tokens: IntArray = field(default_factory=_empty)
    """Draft slots per scheduled request, in num_scheduled_tokens order (empty: none)."""
    kv_connector_metadata: bytes = b""
    """The KV connector's metadata for the step, in its own encoding (b"": none); a step may
    schedule no tokens and carry only this."""

    @property
    def num_reqs(self) -> int:
        return len(self.scheduled_new_reqs) + self.scheduled_cached_reqs.num_reqs

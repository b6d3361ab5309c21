"""One engine step as sent to every worker rank (worker.v1.SchedulerOutput), in domain form.

Ranks keep per-request state, so a request travels in full once (NewRequestData) and
afterwards only as column-wise diffs (CachedRequestData).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve_runtime.tracing import TraceContext


@dataclass(slots=True)
class NewRequestData:
    """A request sent to the ranks for the first time; `block_ids` are all of its blocks.
    `sampler_params` is the serialized common.v1.SamplerParams, as the frontend built it;
    `output_token_ids` are the outputs of a request that resumes after a restart."""

    req_handle: int
    request_id: str
    prompt_token_ids: list[int]
    sampler_params: bytes
    block_ids: list[int]
    num_computed_tokens: int
    stop_token_ids: tuple[int, ...]
    min_tokens: int
    mm_features: list[bytes] = field(default_factory=list)
    """The serialized common.v1.MultiModalFeature of each image, as the frontend sent them."""
    output_token_ids: list[int] = field(default_factory=list)
    lora_id: int = 0
    """The LoRA adapter it runs with (0: the base model)."""
    trace: TraceContext | None = None
    """The core's span of the request, for the workers' spans (None: not traced)."""
    pooling_task: str = ""
    """A pooling request's task: the ranks pool its prompt instead of sampling."""
    state_slot: int = 0
    """Its state slot (a model with state layers; 0: none)."""


@dataclass(slots=True)
class CachedRequestData:
    """Already-known requests scheduled again, column by column.

    Entry i of each per-request column belongs to req_handles[i]; the flattened columns
    (new_block_ids, new_token_ids) are cut by their num_* companions. Resumed requests are
    in req_handles too (their new_block_ids replace the rank's block list) and are listed
    again in resumed_req_handles with all their token ids.
    """

    req_handles: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_new_block_ids: list[int] = field(default_factory=list)
    new_block_ids: list[int] = field(default_factory=list)
    num_new_token_ids: list[int] = field(default_factory=list)
    new_token_ids: list[int] = field(default_factory=list)
    resumed_req_handles: list[int] = field(default_factory=list)
    num_resumed_token_ids: list[int] = field(default_factory=list)
    resumed_all_token_ids: list[int] = field(default_factory=list)
    resumed_state_slots: list[int] = field(default_factory=list)
    """The state slot of each resumed request (a model with state layers; else empty)."""

    def add_resumed(
        self,
        req_handle: int,
        num_computed_tokens: int,
        block_ids: list[int],
        token_ids: list[int],
        state_slot: int = 0,
    ) -> None:
        """Append a resumed request: all its block ids and all its token ids."""
        if state_slot:
            self.resumed_state_slots.append(state_slot)
        self.req_handles.append(req_handle)
        self.num_computed_tokens.append(num_computed_tokens)
        self.num_new_block_ids.append(len(block_ids))
        self.new_block_ids += block_ids
        self.num_new_token_ids.append(0)
        self.resumed_req_handles.append(req_handle)
        self.num_resumed_token_ids.append(len(token_ids))
        self.resumed_all_token_ids += token_ids

    def remove_entry(self, index: int) -> None:
        """Drop entry `index` (a non-resumed request) and its slices of the flat columns."""
        block_start = sum(self.num_new_block_ids[:index])
        del self.new_block_ids[block_start : block_start + self.num_new_block_ids[index]]
        token_start = sum(self.num_new_token_ids[:index])
        del self.new_token_ids[token_start : token_start + self.num_new_token_ids[index]]
        for column in (
            self.req_handles,
            self.num_computed_tokens,
            self.num_new_block_ids,
            self.num_new_token_ids,
        ):
            del column[index]


@dataclass(slots=True)
class GrammarBitmask:
    """Allowed-token masks of a step's constrained requests: one row of ceil(vocab / 32)
    little-endian int32 words per entry of req_handles, concatenated in `bitmask`."""

    req_handles: list[int]
    bitmask: bytes


@dataclass(slots=True)
class LoraSlots:
    """LoRA slot changes, column by column: adapter lora_ids[i] (its folder lora_paths[i]) now
    sits in slot slots[i]; id 0 empties the slot."""

    slots: list[int]
    lora_ids: list[int]
    lora_paths: list[str]


@dataclass(slots=True)
class SchedulerOutput:
    """One step: num_scheduled_tokens has one entry per scheduled_new_reqs, then one per
    scheduled_cached_reqs.req_handles; finished_req_handles were freed since the last step."""

    step_id: int
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    finished_req_handles: list[int] = field(default_factory=list)
    scheduled_encoder_inputs: dict[int, list[int]] = field(default_factory=dict)
    """Request handle -> indices of its mm_features whose encoder runs this step."""
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    """Encoder cache entries the workers drop before the step."""
    grammar_bitmask: GrammarBitmask | None = None
    """Masks of the constrained requests that sample in this step (structured outputs)."""
    has_pending_grammar: bool = False
    """The bitmask follows in a message of its own (it needs an older step's tokens)."""
    lora_slots: LoraSlots | None = None
    """LoRA slots changed since the previous step (None: none)."""
    free_lora_ids: list[int] = field(default_factory=list)
    """Unloaded LoRA adapters no request uses any more: the workers drop them."""
    num_spec_tokens: list[int] = field(default_factory=list)
    """Speculative decoding: draft slots per scheduled request, in num_scheduled_tokens order
    (each included in its num_scheduled_tokens); empty when the step has none."""
    kv_connector_metadata: bytes = b""
    """The KV connector's metadata for the ranks (its own serialized message; b"": none)."""

"""Where the gateway contract's protobuf stops: smg-grpc-proto's VllmEngine messages <-> the
frontend's own types (Generate's replies: generate_response.py's ResponseBuilder, imported
here for `convert.ResponseBuilder`).

Requests are read as vLLM's own servicer reads them (smg_grpc_servicer.vllm: an unset
temperature is 1.0, a zero top_p or repetition_penalty means "off", n 0 means 1, the
`constraint` oneof is one StructuredOutputsParams), then checked by the same InputProcessor as
the public API. What this engine cannot honour yet is refused by the name of the field that asks
for it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import common_pb2

from frontend_svc.engine.engine_types import EngineInfo
from frontend_svc.errors import InvalidRequest
from frontend_svc.gateway import kv_params
from frontend_svc.gateway.generate_response import ResponseBuilder as ResponseBuilder
from frontend_svc.gateway.loads import EngineLoad
from frontend_svc.kv_events.hub import AllBlocksCleared, BlocksRemoved, BlocksStored, KvEvent
from frontend_svc.requests import Embedding, GenerateInput, PromptInput
from splitserve_contracts.sampling_types import SamplingParams
from splitserve_contracts.structured_outputs import StructuredOutputsParams

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
MAX_ABORT_IDS = 1024
MAX_REQUEST_ID_CHARS = 256
UNSUPPORTED_REQUEST_FIELDS = {
    "mm_inputs": "preprocessed multimodal inputs are not supported over this contract",
    "media_refs": "media references are not supported over this contract",
}
UNSUPPORTED = "this engine cannot honour it yet; send the request without it"


def _refuse(field: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"{field}: {why}; {UNSUPPORTED}", field)


def check_request_fields(msg: pb.GenerateRequest, data_parallel_rank: int) -> None:
    """Refuse, by name, what the request asks for that this engine does not do."""
    for name, why in UNSUPPORTED_REQUEST_FIELDS.items():
        if msg.HasField(name):
            raise _refuse(name, why)
    if msg.extra_mm_inputs:
        raise _refuse("extra_mm_inputs", UNSUPPORTED_REQUEST_FIELDS["mm_inputs"])
    if msg.HasField("data_parallel_rank") and msg.data_parallel_rank != data_parallel_rank:
        raise InvalidRequest(
            f"data_parallel_rank {msg.data_parallel_rank}: this engine is data-parallel rank "
            f"{data_parallel_rank}; leave the field unset or send it there",
            "data_parallel_rank",
        )
    if len(msg.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(
            f"request_id has {len(msg.request_id)} characters; at most {MAX_REQUEST_ID_CHARS}",
            "request_id",
        )


CONSTRAINT_KINDS = {
    "json_schema": "json",
    "regex": "regex",
    "grammar": "grammar",
    "structural_tag": "structural_tag",
}
"""The gateway's string constraints -> vLLM's StructuredOutputsParams names (as vLLM's servicer
maps them); `json_object` and `choice` have their own shapes."""


VLLM_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "repetition_penalty": 1.0,
    "n": 1,
}
"""What vLLM's servicer reads for these when unset (temperature, `optional`) or zero (the rest:
not `optional`, and zero means "off", or one completion). Any other `optional` field reads as
the record's default when unset (None for seed, max_tokens, logprobs, prompt_logprobs)."""

NOT_COPIED = {
    **dict.fromkeys(
        (*CONSTRAINT_KINDS, "json_object", "choice"),
        "the `constraint` oneof, read by structured_outputs_from_proto",
    ),
    "truncate_prompt_tokens": "cuts the prompt (_truncated), not a sampling setting",
    "grammar_from_first_token": "nothing to do: a gateway request's grammar starts at its first "
    "token set or not (its GenerateInput carries no `reasoning` to hold the grammar back)",
}
"""smg's SamplingParams fields that are not copied by name, and why. The gateway's proto is
upstream's: a field it gains that is neither one of our record's nor listed here fails
test_gateway_convert, so an smg-grpc-proto upgrade cannot drop a knob unseen."""

RECORD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
COPIED = tuple(
    f
    for f in pb.SamplingParams.DESCRIPTOR.fields
    if f.name in RECORD_DEFAULTS and f.name not in NOT_COPIED
)
"""smg's SamplingParams fields that our SamplingParams record has too, copied by name."""


def _copied_value(msg: pb.SamplingParams, field: FieldDescriptor) -> Any:
    """One field as vLLM's servicer reads it: map -> dict, repeated -> tuple, unset `optional`
    or zero -> VLLM_DEFAULTS' value or the record's default."""
    name = field.name
    value = getattr(msg, name)
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        return dict(value)
    if field.is_repeated:
        return tuple(value)
    if field.has_presence and not msg.HasField(name):
        return VLLM_DEFAULTS.get(name, RECORD_DEFAULTS[name])
    if name in VLLM_DEFAULTS and not field.has_presence and not value:
        return VLLM_DEFAULTS[name]
    return value


def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """vLLM's servicer's reading of the gateway's sampling parameters, field by field as the
    descriptor lists them (COPIED); InputProcessor validates the result."""
    return SamplingParams(**{f.name: _copied_value(msg, f) for f in COPIED})


def structured_outputs_from_proto(msg: pb.SamplingParams) -> StructuredOutputsParams | None:
    """The `constraint` oneof as vLLM's servicer reads it; None when unset. InputProcessor
    validates and compiles it (naming `sampling_params.<kind>` when it is refused)."""
    kind = msg.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "choice":
        return StructuredOutputsParams(choice=tuple(msg.choice.choices))
    if kind == "json_object":
        if not msg.json_object:
            raise InvalidRequest(
                "sampling_params.json_object is false; set it to true to force a JSON object, "
                "or leave the constraint out",
                "sampling_params.json_object",
            )
        return StructuredOutputsParams(json_object=True)
    return StructuredOutputsParams(**{CONSTRAINT_KINDS[kind]: getattr(msg, kind)})


def _truncated(ids: list[int], msg: pb.SamplingParams, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last k prompt tokens (-1: max_model_len)."""
    if not msg.HasField("truncate_prompt_tokens"):
        return ids
    k = msg.truncate_prompt_tokens
    if k == -1:
        k = max_model_len
    if k < 1:
        raise InvalidRequest(
            f"truncate_prompt_tokens is {msg.truncate_prompt_tokens}; use -1 (max_model_len) "
            "or a count >= 1",
            "sampling_params.truncate_prompt_tokens",
        )
    return ids[-k:]


def generate_input_from_proto(
    msg: pb.GenerateRequest, request_id: str, max_model_len: int, kv_params_json: str = ""
) -> GenerateInput:
    """The request as the public API's InputProcessor takes it (tokenized, or text), with its
    checked kv_transfer_params_json (kv_params.kv_transfer_params_json)."""
    kind = msg.WhichOneof("input")
    if kind == "tokenized":
        ids = _truncated(list(msg.tokenized.input_ids), msg.sampling_params, max_model_len)
        prompt = PromptInput(token_ids=tuple(ids))
    elif kind == "text":
        prompt = PromptInput(text=msg.text)
    else:
        raise InvalidRequest("no prompt: set `tokenized` (input_ids) or `text`", "input")
    params = msg.sampling_params
    call = GenerateInput(
        request_id,
        prompt,
        sampling_params_from_proto(params),
        kv_transfer_params_json=kv_params_json,
    )
    kind = params.WhichOneof("constraint")
    if kind is None:
        return call
    return dataclasses.replace(
        call,
        structured_outputs=structured_outputs_from_proto(params),
        structured_outputs_field=f"sampling_params.{kind}",
    )


def model_info_to_proto(
    info: EngineInfo,
    served_model_name: str,
    tokenizer: Any,
    eos_token_ids: Iterable[int],
    sampling_defaults: Mapping[str, Any],
    model_config: Mapping[str, Any],
) -> pb.GetModelInfoResponse:
    """The model's facts; paths are never disclosed (the gateway fetches the tokenizer with
    GetTokenizer)."""
    architectures = model_config.get("architectures") or []
    return pb.GetModelInfoResponse(
        model_path=served_model_name,
        is_generation=info.pooler_config is None,
        max_context_length=info.max_model_len,
        vocab_size=info.vocab_size,
        supports_vision=False,
        served_model_name=served_model_name,
        tokenizer_path="",
        model_type=str(model_config.get("model_type") or ""),
        architectures=[str(a) for a in architectures if isinstance(a, str)],
        eos_token_ids=list(eos_token_ids),
        pad_token_id=_token_id(tokenizer.pad_token_id),
        bos_token_id=_token_id(tokenizer.bos_token_id),
        max_req_input_len=info.max_model_len,
        default_sampling_params_json=json.dumps(dict(sampling_defaults), default=list)
        if sampling_defaults
        else "",
    )


def _token_id(value: Any) -> int:
    return value if isinstance(value, int) else 0


def server_info_to_proto(
    info: EngineInfo,
    active_requests: int,
    is_paused: bool,
    last_receive_timestamp: float,
    uptime_seconds: float,
    data_parallel_size: int,
) -> pb.GetServerInfoResponse:
    return pb.GetServerInfoResponse(
        active_requests=active_requests,
        is_paused=is_paused,
        last_receive_timestamp=last_receive_timestamp,
        uptime_seconds=uptime_seconds,
        server_type="vllm-grpc",
        data_parallel_size=data_parallel_size,
        kv_cache_dtype=info.options.cache.kv_cache_dtype,
        block_size=info.options.cache.block_size,
        model_dtype=f"torch.{info.dtype}" if info.dtype else "",
        max_num_seqs=info.options.scheduler.max_num_seqs,
        **kv_params.kv_connector_facts(info),
    )


def scheduler_load_to_proto(load: EngineLoad, dp_rank: int) -> pb.SchedulerLoad:
    return pb.SchedulerLoad(
        dp_rank=dp_rank,
        num_running_reqs=load.num_running,
        num_waiting_reqs=load.num_waiting,
        num_total_reqs=load.num_running + load.num_waiting,
        num_used_tokens=load.num_used_tokens,
        max_total_num_tokens=load.max_total_num_tokens,
        token_usage=load.token_usage,
        gen_throughput=load.gen_throughput,
        cache_hit_rate=load.cache_hit_rate,
        utilization=load.token_usage,
        max_running_requests=load.max_running_requests,
        num_waiting_uncached_tokens=load.num_waiting_uncached_tokens,
    )


def add_lora_load(load: EngineLoad, record: common_pb2.EngineLoad) -> None:
    """The load record's LoRA section (slots the running adapters hold, of --max-loras), for
    smg's LoRA-aware policies; left unset when the engine serves no LoRA."""
    if load.lora_slots <= 0:
        return
    used = min(load.num_running_adapters, load.lora_slots)
    record.lora.slots_used = used
    record.lora.slots_total = load.lora_slots
    record.lora.utilization = used / load.lora_slots


def _to_int64(value: int) -> int:
    """An unsigned 64-bit hash as the proto's signed int64 (same bits)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _stored_to_proto(event: BlocksStored, block_size: int, msg: common_pb2.KvBlocksStored) -> None:
    tokens = event.token_ids
    for i, block_hash in enumerate(event.block_hashes):
        block = msg.blocks.add(
            block_hash=_to_int64(block_hash),
            token_ids=tokens[i * block_size : (i + 1) * block_size],
            block_size=block_size,
        )
        keys = event.extra_keys[i] if event.extra_keys else None
        if keys is not None:
            if keys.lora_name:  # vLLM's order: the LoRA name, images, the salt
                block.extra_keys.add(text=keys.lora_name)
                block.lora_id = keys.lora_id
                msg.lora_name = keys.lora_name
            for identifier, offset in keys.multimodal:
                block.extra_keys.add().multimodal.CopyFrom(
                    common_pb2.KvMultimodalKey(identifier=identifier, offset=offset)
                )
            if keys.cache_salt:
                block.extra_keys.add(text=keys.cache_salt)
                msg.cache_salt = keys.cache_salt
    if event.parent_block_hash is not None:
        msg.parent_block_hash = _to_int64(event.parent_block_hash)
    msg.tier = common_pb2.KV_CACHE_TIER_DEVICE
    msg.medium = "GPU"
    msg.group_idx = 0
    msg.locality = common_pb2.KV_CACHE_LOCALITY_LOCAL


def kv_batch_to_proto(
    events: list[KvEvent],
    sequence_number: int,
    timestamp: float,
    block_size: int,
    first_event_id: int,
) -> common_pb2.KvEventBatch:
    """One batch of the gateway's KV-event stream; its events are numbered from
    `first_event_id` on (the stream's count)."""
    msg = common_pb2.KvEventBatch(sequence_number=sequence_number, timestamp=timestamp)
    for event_id, event in enumerate(events, start=first_event_id):
        entry = msg.events.add(event_id=event_id)
        if isinstance(event, BlocksStored):
            _stored_to_proto(event, block_size, entry.stored)
        elif isinstance(event, BlocksRemoved):
            entry.removed.block_hashes.extend(_to_int64(h) for h in event.block_hashes)
            entry.removed.tier = common_pb2.KV_CACHE_TIER_DEVICE
            entry.removed.medium = "GPU"
            entry.removed.group_idx = 0
            entry.removed.locality = common_pb2.KV_CACHE_LOCALITY_LOCAL
        else:
            assert isinstance(event, AllBlocksCleared)
            entry.cleared.SetInParent()
    return msg


def check_flush_timeout(timeout_s: float) -> None:
    if not math.isfinite(timeout_s) or timeout_s < 0:
        raise InvalidRequest("timeout_s must be finite and >= 0", "timeout_s")


def embed_input_from_proto(msg: pb.EmbedRequest) -> PromptInput:
    """The token ids of an Embed call (the gateway tokenizes)."""
    if not msg.HasField("tokenized") or not msg.tokenized.input_ids:
        raise InvalidRequest("no input: set `tokenized.input_ids`", "tokenized.input_ids")
    return PromptInput(token_ids=tuple(msg.tokenized.input_ids))


def embedding_to_proto(embedding: Embedding) -> pb.EmbedResponse:
    return pb.EmbedResponse(
        embedding=embedding.vector.tolist(),
        prompt_tokens=embedding.num_prompt_tokens,
        embedding_dim=len(embedding.vector),
    )

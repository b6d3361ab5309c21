"""Where protobuf stops: public and core contracts <-> the frontend's own types."""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf import json_format
from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

from frontend_svc.engine_types import (
    CoreOutputDetail,
    CoreOutputs,
    EngineInfo,
    EngineSnapshot,
    HistogramState,
    LoraAdapterInfo,
    TokenizerInfo,
)
from frontend_svc.errors import InvalidRequest
from frontend_svc.kv_events import (
    AllBlocksCleared,
    BlockExtraKeys,
    BlocksRemoved,
    BlocksStored,
    KvEvent,
    KvEvents,
)
from frontend_svc.requests import (
    ChatTurn,
    CompletionDelta,
    ContentPart,
    Embedding,
    EngineRequest,
    GenerateInput,
    ImageInput,
    Logprob,
    PromptInput,
    TokenLogprobs,
    ToolCallInput,
)
from splitserve_contracts import sampling_convert, structured_outputs
from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.core.v1 import core_service_pb2 as core_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
from splitserve_contracts.output_convert import (
    engine_core_event_from_proto,
    enum_member,
    logprobs_table_from_proto,
    pooler_config_from_proto,
    scheduler_stats_from_proto,
)
from splitserve_contracts.output_types import ErrorKind, FinishReason
from splitserve_contracts.sampling_types import SamplingParams
from splitserve_contracts.structured_outputs import StructuredOutputsParams


def _part_from_proto(part: gen_pb2.ContentPart, where: str) -> ContentPart:
    if part.WhichOneof("part") != "image":
        return ContentPart(text=part.text)
    image = part.image
    source = image.WhichOneof("source")
    return ContentPart(
        image=ImageInput(
            where=f"{where}.image",
            data=image.data if source == "data" else None,
            mime_type=image.mime_type,
            url=image.url if source == "url" else None,
        )
    )


def _turn_from_proto(message: gen_pb2.ChatMessage, index: int) -> ChatTurn:
    where = f"chat.messages[{index}].content_parts"
    parts = tuple(_part_from_proto(p, f"{where}[{j}]") for j, p in enumerate(message.content_parts))
    calls = tuple(
        _call_from_proto(c, f"chat.messages[{index}].tool_calls[{j}]")
        for j, c in enumerate(message.tool_calls)
    )
    return ChatTurn(
        message.role,
        message.content,
        parts,
        tool_calls=calls,
        tool_call_id=message.tool_call_id,
        name=message.name,
        reasoning=message.reasoning,
    )


def _call_from_proto(call: gen_pb2.ToolCall, where: str) -> ToolCallInput:
    try:
        arguments = json.loads(call.arguments or "{}")
    except ValueError as err:
        raise InvalidRequest(
            f"{where}.arguments is not valid JSON: {err}", f"{where}.arguments"
        ) from None
    if not isinstance(arguments, dict):
        raise InvalidRequest(f"{where}.arguments must be a JSON object", f"{where}.arguments")
    if not call.name:
        raise InvalidRequest(f"{where}.name is required", f"{where}.name")
    return ToolCallInput(call.id, call.name, arguments)


def _chat_from_proto(chat: gen_pb2.Chat) -> tuple[tuple[ChatTurn, ...], bool]:
    turns = tuple(_turn_from_proto(m, i) for i, m in enumerate(chat.messages))
    add_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    return turns, add_prompt


TOOL_CHOICE_MODES = {
    gen_pb2.TOOL_CHOICE_MODE_NONE: "none",
    gen_pb2.TOOL_CHOICE_MODE_AUTO: "auto",
    gen_pb2.TOOL_CHOICE_MODE_REQUIRED: "required",
}


def tools_body_from_proto(msg: gen_pb2.GenerateRequest) -> dict[str, Any] | None:
    """The request's tool fields in the HTTP API's JSON shapes (checked by the same rules,
    openai/tools.py, in the servicer); None: no tool field is set."""
    body: dict[str, Any] = {}
    if msg.tools:
        body["tools"] = [_tool_from_proto(t, i) for i, t in enumerate(msg.tools)]
    if msg.HasField("tool_choice"):
        kind = msg.tool_choice.WhichOneof("choice")
        if kind == "function_name":
            name = msg.tool_choice.function_name
            body["tool_choice"] = {"type": "function", "function": {"name": name}}
        elif kind == "mode" and msg.tool_choice.mode in TOOL_CHOICE_MODES:
            body["tool_choice"] = TOOL_CHOICE_MODES[msg.tool_choice.mode]
    if msg.HasField("parallel_tool_calls"):
        body["parallel_tool_calls"] = msg.parallel_tool_calls
    if body and msg.WhichOneof("input") != "chat":
        raise InvalidRequest("tools need a chat prompt", "tools")
    return body or None


def _tool_from_proto(tool: gen_pb2.Tool, index: int) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters_json:
        try:
            function["parameters"] = json.loads(tool.parameters_json)
        except ValueError as err:
            where = f"tools[{index}].parameters_json"
            raise InvalidRequest(f"{where} is not valid JSON: {err}", where) from None
    if tool.strict:
        function["strict"] = True
    return {"type": "function", "function": function}


def prompt_from_proto(msg: gen_pb2.GenerateRequest | gen_pb2.TokenizeRequest) -> PromptInput:
    """The `input` oneof of a Generate or Tokenize request."""
    add_special = msg.add_special_tokens if msg.HasField("add_special_tokens") else True
    kind = msg.WhichOneof("input")
    if kind == "chat":
        turns, add_prompt = _chat_from_proto(msg.chat)
        kwargs = None
        if msg.chat.HasField("chat_template_kwargs"):
            kwargs = json_format.MessageToDict(msg.chat.chat_template_kwargs)
        return PromptInput(
            chat=turns, add_generation_prompt=add_prompt, chat_template_kwargs=kwargs
        )
    if kind == "prompt_token_ids":
        assert isinstance(msg, gen_pb2.GenerateRequest)
        return PromptInput(token_ids=tuple(msg.prompt_token_ids.ids))
    if kind == "prompt":
        return PromptInput(text=msg.prompt, add_special_tokens=add_special)
    return PromptInput()


def embed_inputs_from_proto(msg: gen_pb2.EmbedRequest, max_fan_out: int) -> list[PromptInput]:
    """The inputs of an Embed call: at least one, at most `max_fan_out`, each set."""
    if not 0 < len(msg.inputs) <= max_fan_out:
        raise InvalidRequest(
            f"send 1 to {max_fan_out} inputs (--max-fan-out), not {len(msg.inputs)}", "inputs"
        )
    add_special = msg.add_special_tokens if msg.HasField("add_special_tokens") else True
    prompts = []
    for i, item in enumerate(msg.inputs):
        kind = item.WhichOneof("input")
        if kind is None:
            raise InvalidRequest(f"inputs[{i}] sets neither `text` nor `token_ids`", f"inputs[{i}]")
        if kind == "text":
            prompts.append(PromptInput(text=item.text, add_special_tokens=add_special))
        else:
            prompts.append(PromptInput(token_ids=tuple(item.token_ids.ids)))
    return prompts


def embed_response_to_proto(request_id: str, embedded: list[Embedding]) -> gen_pb2.EmbedResponse:
    reply = gen_pb2.EmbedResponse(request_id=request_id)
    for e in embedded:
        reply.embeddings.add(values=e.vector.tolist(), prompt_tokens=e.num_prompt_tokens)
    return reply


def generate_input_from_proto(
    msg: gen_pb2.GenerateRequest, request_id: str, defaults: Mapping[str, Any] | None = None
) -> GenerateInput:
    """`defaults` (the generation config's) fill the sampling fields the request leaves unset."""
    return GenerateInput(
        request_id=request_id,
        prompt=prompt_from_proto(msg),
        params=sampling_convert.from_proto(msg.sampling_params, SamplingParams, defaults),
        priority=msg.priority,
        cache_salt=msg.cache_salt,
        structured_outputs=_structured_outputs_from_proto(msg),
    )


def _structured_outputs_from_proto(msg: gen_pb2.GenerateRequest) -> StructuredOutputsParams | None:
    if not msg.HasField("structured_outputs"):
        return None
    params = structured_outputs.from_proto(msg.structured_outputs)
    if params is None:
        raise InvalidRequest(
            "structured_outputs is set but empty; set one constraint or leave it out",
            "structured_outputs",
        )
    return params


def _logprob_to_proto(src: Logprob, dst: types_pb2.Logprob) -> None:
    dst.token_id, dst.logprob, dst.rank = src.token_id, src.logprob, src.rank
    dst.decoded_token = src.decoded_token


def _token_logprobs_to_proto(
    rows: list[TokenLogprobs], out: RepeatedCompositeFieldContainer[types_pb2.TokenLogprobs]
) -> None:
    for row in rows:
        entry = out.add()
        _logprob_to_proto(row.chosen, entry.chosen)
        for top in row.top:
            _logprob_to_proto(top, entry.top.add())


def delta_to_proto(
    request_id: str,
    delta: CompletionDelta,
    parsed: dict[str, Any] | None = None,
    calls: Sequence[tuple[str, str, str]] = (),
) -> gen_pb2.GenerateResponse:
    """One piece of a completion; `parsed` (chat_output's fields) replaces the raw text with
    the answer, its thinking and, on the last piece, `calls` (id, name, arguments)."""
    msg = gen_pb2.GenerateResponse(
        request_id=request_id,
        index=delta.index,
        token_ids=delta.token_ids,
        text=delta.text if parsed is None else parsed.get("content", ""),
        reasoning=parsed.get("reasoning", "") if parsed is not None else "",
        finish_reason=int(delta.finish_reason),  # type: ignore[arg-type]
        usage=gen_pb2.Usage(
            prompt_tokens=delta.prompt_tokens,
            completion_tokens=delta.completion_tokens,
            cached_tokens=delta.cached_tokens,
        ),
    )
    if delta.stop_str is not None:
        msg.stop_str = delta.stop_str
    elif delta.stop_token_id is not None:
        msg.stop_token_id = delta.stop_token_id
    for call_id, name, arguments in calls:
        msg.tool_calls.add(id=call_id, name=name, arguments=arguments)
    if delta.logprobs:
        _token_logprobs_to_proto(delta.logprobs, msg.logprobs)
    if delta.prompt_logprobs:
        _token_logprobs_to_proto(delta.prompt_logprobs, msg.prompt_logprobs)
    return msg


def tokenizer_info_to_proto(info: TokenizerInfo) -> core_pb2.EngineStreamRequest:
    """The stream's first message: the tokenizer the core compiles grammars with."""
    msg = core_pb2.EngineStreamRequest()
    msg.tokenizer.tokenizer_json = info.tokenizer_json
    msg.tokenizer.eos_token_ids.extend(info.eos_token_ids)
    return msg


def engine_request_to_proto(handle: int, req: EngineRequest) -> core_pb2.EngineCoreRequest:
    """The engine core reads the stop conditions; the sampler's part of the params travels
    in sampler_params, copied field by field (same names) from SamplingParams."""
    params = req.params
    assert params.max_tokens is not None, "InputProcessor resolves max_tokens"
    msg = core_pb2.EngineCoreRequest(
        request_id=req.request_id,
        request_handle=handle,
        prompt_token_ids=req.prompt_token_ids,
        cache_salt=req.cache_salt,
        priority=req.priority,
        max_tokens=0 if req.pooling_task else params.max_tokens,
        min_tokens=params.min_tokens,
        stop_token_ids=params.stop_token_ids,
    )
    if req.pooling_task:
        msg.pooling_params.task = req.pooling_task
    if req.eos_token_id is not None:
        msg.eos_token_id = req.eos_token_id
    if req.output_token_ids:
        msg.output_token_ids.extend(req.output_token_ids)
    msg.resumed = req.is_resumed
    msg.lora_name = req.lora_name
    if req.trace is not None:
        msg.trace_context.traceparent = req.trace.traceparent
        msg.trace_context.tracestate = req.trace.tracestate
    sampling_convert.to_proto(params, msg.sampler_params)
    if req.structured_outputs is not None:
        structured_outputs.to_proto(req.structured_outputs, msg.structured_outputs)
        if req.reasoning_end_token_id is not None:
            msg.reasoning_end_token_id = req.reasoning_end_token_id
    for feature in req.mm_features:
        entry = msg.mm_features.add(
            modality=feature.modality,
            identifier=feature.identifier,
            offset=feature.offset,
            length=feature.length,
        )
        entry.pixel_values.data = feature.data
        entry.pixel_values.shape.extend(feature.shape)
        entry.pixel_values.dtype = feature.dtype
    return msg


def _detail_from_proto(d: core_pb2.EngineCoreOutput) -> CoreOutputDetail:
    has = d.HasField
    return CoreOutputDetail(
        handle=d.request_handle,
        finish_reason=enum_member(FinishReason, d.finish_reason),
        stop_token_id=d.stop_token_id if has("stop_token_id") else None,
        new_logprobs=logprobs_table_from_proto(d.new_logprobs) if has("new_logprobs") else None,
        prompt_logprobs=(
            logprobs_table_from_proto(d.prompt_logprobs) if has("prompt_logprobs") else None
        ),
        events=[engine_core_event_from_proto(e) for e in d.events],
        num_cached_tokens=d.num_cached_tokens if has("num_cached_tokens") else None,
        error_message=d.error_message,
        error_kind=enum_member(ErrorKind, d.error_kind),
        pooling_output=d.pooling_output,
    )


HASH_BYTES = 32


def _external_hashes(data: bytes) -> list[int]:
    """32-byte prefix-cache hashes, concatenated -> vLLM's external block hashes (the low 64
    bits of each digest, unsigned)."""
    if len(data) % HASH_BYTES:
        raise ValueError(f"block_hashes of {len(data)} bytes is not a list of 32-byte hashes")
    return [int.from_bytes(data[i + 24 : i + 32], "big") for i in range(0, len(data), HASH_BYTES)]


def _stored_from_proto(msg: core_pb2.KvBlocksStored, block_size: int) -> BlocksStored:
    hashes = _external_hashes(msg.block_hashes)
    parent = msg.parent_block_hash
    if not hashes or len(parent) not in (0, HASH_BYTES):
        raise ValueError("a stored run needs blocks and a 32-byte parent hash (or none)")
    if len(msg.token_ids) != len(hashes) * block_size:
        raise ValueError(f"{len(msg.token_ids)} token ids for {len(hashes)} full blocks")
    if msg.extra_keys and len(msg.extra_keys) != len(hashes):
        raise ValueError("extra_keys must name every block of the run or none")
    extra = [
        BlockExtraKeys(
            k.cache_salt,
            tuple((m.identifier, m.offset) for m in k.multimodal),
            k.lora_name,
            msg.lora_id if k.lora_name else 0,
        )
        for k in msg.extra_keys
    ]
    return BlocksStored(
        hashes,
        int.from_bytes(parent[24:32], "big") if parent else None,
        list(msg.token_ids),
        extra or None,
    )


def kv_events_from_proto(msg: core_pb2.KvCacheEvents, block_size: int) -> KvEvents:
    """The core's events; ValueError when one is malformed (the batch cannot be trusted)."""
    events: list[KvEvent] = []
    for entry in msg.events:
        kind = entry.WhichOneof("event")
        if kind == "stored":
            events.append(_stored_from_proto(entry.stored, block_size))
        elif kind == "removed":
            events.append(BlocksRemoved(_external_hashes(entry.removed.block_hashes)))
        elif kind == "cleared":
            events.append(AllBlocksCleared())
        else:
            raise ValueError("a KV-cache event with no kind")
    return KvEvents(events)


def core_outputs_from_proto(msg: core_pb2.EngineCoreOutputs) -> CoreOutputs:
    return CoreOutputs(
        handles=list(msg.request_handles),
        num_new_tokens=list(msg.num_new_tokens),
        new_token_ids=list(msg.new_token_ids),
        details={d.request_handle: _detail_from_proto(d) for d in msg.details},
        timestamp=msg.timestamp,
        step_id=msg.step_id,
        scheduler_stats=(
            scheduler_stats_from_proto(msg.scheduler_stats)
            if msg.HasField("scheduler_stats")
            else None
        ),
    )


def engine_info_from_proto(msg: core_pb2.EngineInfo) -> EngineInfo:
    return EngineInfo(
        served_model_name=msg.served_model_name,
        model_path=msg.model_path,
        max_model_len=msg.max_model_len,
        vocab_size=msg.vocab_size,
        block_size=msg.block_size,
        num_kv_blocks=msg.num_kv_blocks,
        tensor_parallel_size=msg.tensor_parallel_size,
        pipeline_parallel_size=msg.pipeline_parallel_size,
        dtype=msg.dtype,
        max_num_seqs=msg.max_num_seqs,
        max_num_batched_tokens=msg.max_num_batched_tokens,
        enable_prefix_caching=msg.enable_prefix_caching,
        engine_id=msg.engine_id,
        max_concurrency=msg.max_concurrency,
        max_tokens_per_mm_item=msg.max_tokens_per_mm_item,
        pooler_config=pooler_config_from_proto(msg.pooler_config)
        if msg.HasField("pooler_config")
        else None,
        max_loras=msg.max_loras,
        max_lora_rank=msg.max_lora_rank,
        cache_dtype=msg.cache_dtype or "auto",
    )


def lora_adapter_from_proto(msg: core_pb2.LoraAdapter) -> LoraAdapterInfo:
    return LoraAdapterInfo(msg.name, msg.path, msg.base_model_name, msg.max_rank)


def engine_snapshot_from_proto(msg: core_pb2.GetSchedulerStatsResponse) -> EngineSnapshot:
    """The core's stats and step histogram; a histogram whose counts do not match its bounds
    (one more than them, never decreasing) is dropped, not exported wrong."""
    stats = scheduler_stats_from_proto(msg.scheduler_stats)
    hist = msg.iteration_tokens
    bounds, counts = list(hist.upper_bounds), list(hist.cumulative_counts)
    is_valid = (
        len(counts) == len(bounds) + 1 and _ascending(counts) and _ascending(bounds, strictly=True)
    )
    state = HistogramState(bounds, counts, hist.sum) if is_valid and bounds else None
    return EngineSnapshot(stats, state)


def _ascending(values: list[float] | list[int], strictly: bool = False) -> bool:
    pairs = itertools.pairwise(values)
    return all(a < b for a, b in pairs) if strictly else all(a <= b for a, b in pairs)

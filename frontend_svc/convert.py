"""Where protobuf stops: the public contract (GenerationService) <-> the frontend's own types;
the core's contract is core_convert.py's (its converters that other modules name here are
imported below, so `convert.X` still finds them)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf import json_format
from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

from frontend_svc.engine.core_convert import core_outputs_from_proto as core_outputs_from_proto
from frontend_svc.engine.core_convert import engine_info_from_proto as engine_info_from_proto
from frontend_svc.engine.core_convert import engine_request_to_proto as engine_request_to_proto
from frontend_svc.engine.core_convert import kv_events_from_proto as kv_events_from_proto
from frontend_svc.errors import InvalidRequest
from frontend_svc.requests import (
    ChatTurn,
    CompletionDelta,
    ContentPart,
    Embedding,
    GenerateInput,
    ImageInput,
    Logprob,
    PromptInput,
    TokenLogprobs,
    ToolCallInput,
)
from splitserve_contracts import sampling_convert, structured_outputs
from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
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

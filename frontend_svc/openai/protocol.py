"""The OpenAI request bodies splitserve reads: /v1/completions and /v1/chat/completions.

Plain dict parsing (no per-request model classes): each field is read once, with a 400 naming
it when its type is wrong. Unknown fields are ignored, as vLLM and OpenAI do; fields whose
meaning splitserve cannot honour yet are refused (UNSUPPORTED), never silently dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from frontend_svc import kv_transfer
from frontend_svc.errors import InvalidRequest, shorten
from frontend_svc.openai.fields import (
    as_bool,
    as_int,
    as_int_within,
    as_list,
    as_object,
    as_str,
    read,
)
from frontend_svc.openai.sampling_map import CHAT, COMPLETIONS, FieldMap, sampling_params
from frontend_svc.openai.structured_map import structured_outputs
from frontend_svc.openai.tools import ToolsRequest, parse_tools, turn_fields
from frontend_svc.requests import (
    DEFAULT_MAX_FAN_OUT,
    MAX_REQUEST_ID_CHARS,
    ChatTurn,
    ContentPart,
    ImageInput,
    PromptInput,
)
from splitserve_contracts import sampling_rules
from splitserve_contracts.sampling_rules import INT32_MAX, InvalidSamplingParams, Limits
from splitserve_contracts.sampling_types import SamplingParams
from splitserve_contracts.structured_outputs import StructuredOutputsParams

MEDIA_PARTS = frozenset(
    {"input_image", "image", "image_embeds", "input_audio", "audio_url", "video_url"}
)
"""Media part types other than `image_url`: refused with a message saying what to send."""


def _set(value: Any) -> bool:
    return value not in (None, False, "", [], {})


UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "suffix": _set,
    "best_of": lambda v: v not in (None, 1),
    "use_beam_search": _set,
    "functions": _set,
    "prompt_embeds": _set,
    "bad_words": _set,
    "logits_processors": _set,
    "truncate_prompt_tokens": _set,
    "chat_template": _set,
    "return_tokens_as_token_ids": _set,
    "kv_transfer_params": _set,
}
"""Fields splitserve refuses (when set to anything but their neutral value) rather than ignore;
`kv_transfer_params` only when the engine has no KV connector."""
KV_PARAMS = "kv_transfer_params"


def _kv_params(body: dict[str, Any], limits: RequestLimits, num_requests: int) -> str:
    """The body's `kv_transfer_params` as JSON text (an engine with a KV connector; else
    _refuse_unsupported refused it); one engine request only."""
    value = body.get(KV_PARAMS)
    if value is None or not limits.has_kv_connector:
        return ""
    text = kv_transfer.params_json_from_object(value, KV_PARAMS)
    kv_transfer.check_one_request(num_requests, KV_PARAMS)
    return text


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What a body is checked against while it is parsed: every number within the contract's
    rules and the call's fan-out (prompts x n engine requests) within the cap, before anything
    is built per prompt or per choice."""

    sampling: Limits
    max_fan_out: int = DEFAULT_MAX_FAN_OUT
    """--max-fan-out."""
    has_kv_connector: bool = False
    """The engine has a KV connector (--kv-transfer-config): `kv_transfer_params` is taken."""


@dataclass(frozen=True, slots=True)
class StreamOptions:
    include_usage: bool = False
    continuous_usage_stats: bool = False


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    model: str | None
    prompts: list[PromptInput]
    params: SamplingParams
    stream: StreamOptions | None
    """None: answer with one JSON response."""
    echo: bool
    priority: int
    cache_salt: str
    request_id: str | None
    structured_outputs: StructuredOutputsParams | None = None
    structured_outputs_field: str = ""
    """The request field the constraint came from (for errors)."""
    kv_transfer_params_json: str = ""
    """vLLM's `kv_transfer_params` as JSON text (frontend_svc/kv_transfer.py); "": none."""


@dataclass(frozen=True, slots=True)
class ChatRequest:
    model: str | None
    prompt: PromptInput
    params: SamplingParams
    stream: StreamOptions | None
    priority: int
    cache_salt: str
    request_id: str | None
    structured_outputs: StructuredOutputsParams | None = None
    structured_outputs_field: str = ""
    tools: ToolsRequest | None = None
    include_reasoning: bool = True
    """vLLM's `include_reasoning`: false leaves the thinking out of the answer."""
    kv_transfer_params_json: str = ""


def _refuse_unsupported(
    body: dict[str, Any], limits: RequestLimits, also: tuple[str, ...] = ()
) -> None:
    for name, is_set in UNSUPPORTED.items():
        if name == KV_PARAMS and limits.has_kv_connector:
            continue
        if is_set(body.get(name)):
            raise InvalidRequest(f"`{name}` is not supported by splitserve; leave it out", name)
    for name in also:
        if _set(body.get(name)):
            raise InvalidRequest(f"`{name}` is not supported on this endpoint", name)


def _stream(body: dict[str, Any]) -> StreamOptions | None:
    options = read(body, "stream_options", as_object)
    if not read(body, "stream", as_bool, False):
        if options is not None:
            raise InvalidRequest("`stream_options` needs `stream: true`", "stream_options")
        return None
    options = options or {}
    where = "stream_options"
    return StreamOptions(
        include_usage=read(options, "include_usage", as_bool, False, where),
        continuous_usage_stats=read(options, "continuous_usage_stats", as_bool, False, where),
    )


PRIORITY = as_int_within(-INT32_MAX - 1, INT32_MAX)
"""The contract's `priority` is an int32."""


def _common(body: dict[str, Any]) -> dict[str, Any]:
    constraint, constraint_field = structured_outputs(body)
    return {
        "structured_outputs": constraint,
        "structured_outputs_field": constraint_field,
        "model": read(body, "model", as_str),
        "stream": _stream(body),
        "priority": read(body, "priority", PRIORITY, 0),
        "cache_salt": read(body, "cache_salt", as_str, ""),
        "request_id": read(body, "request_id", as_client_id),
    }


def as_client_id(value: Any, name: str) -> str:
    """A request id a client chose (the body's `request_id`, the `x-request-id` header)."""
    text = as_str(value, name)
    if len(text) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(
            f"{name} has {len(text)} characters; at most {MAX_REQUEST_ID_CHARS}",
            name if name == "request_id" else None,
        )
    return text


def _check_fan_out(num_prompts: int, n: int, max_fan_out: int, name: str = "prompt") -> None:
    if num_prompts * n <= max_fan_out:
        return
    raise InvalidRequest(
        f"{num_prompts} prompts x n = {n} would make {num_prompts * n} engine requests; at most "
        f"{max_fan_out} per call (--max-fan-out): split the prompts over several calls",
        name if num_prompts > 1 else "n",
    )


def prompt_inputs(
    value: Any, add_special_tokens: bool, max_fan_out: int, name: str = "prompt"
) -> list[PromptInput]:
    """str | list[str] | list[int] | list[list[int]] -> one PromptInput per prompt (a list of
    more prompts than the fan-out cap is refused before any is built); `name`: the field."""
    if isinstance(value, str):
        return [PromptInput(text=value, add_special_tokens=add_special_tokens)]
    items = as_list(value, name)
    if not items:
        raise InvalidRequest(f"`{name}` is an empty list; send at least one {name}", name)
    if all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        return [PromptInput(token_ids=tuple(items))]
    is_texts = all(isinstance(i, str) for i in items)
    if is_texts or all(isinstance(i, list) for i in items):
        _check_fan_out(len(items), 1, max_fan_out, name)
    if is_texts:
        return [PromptInput(text=t, add_special_tokens=add_special_tokens) for t in items]
    if all(isinstance(i, list) for i in items):
        return [PromptInput(token_ids=tuple(as_int(t, name) for t in i)) for i in items]
    raise InvalidRequest(
        f"`{name}` must be a string, a list of strings, a list of token ids or a list of lists "
        "of token ids",
        name,
    )


def _checked(
    params: SamplingParams, body: dict[str, Any], fields: FieldMap, limits: RequestLimits
) -> SamplingParams:
    """`params` if every value keeps its rule (the gRPC path's, sampling_rules), else a 400
    naming the request field that set the value."""
    try:
        sampling_rules.validate(params, limits.sampling)
    except InvalidSamplingParams as err:
        param = fields.request_name(body, err.field) if err.field else None
        raise InvalidRequest(str(err), param) from None
    return params


def parse_completion(
    body: dict[str, Any], limits: RequestLimits, defaults: Mapping[str, Any] | None = None
) -> CompletionRequest:
    """A /v1/completions body, checked against `limits`; `defaults` are the model's sampling
    defaults."""
    _refuse_unsupported(body, limits, also=("tools", "tool_choice"))
    if body.get("prompt") is None:
        raise InvalidRequest("`prompt` is required", "prompt")
    add_special = read(body, "add_special_tokens", as_bool, True)
    prompts = prompt_inputs(body["prompt"], add_special, limits.max_fan_out)
    echo = read(body, "echo", as_bool, False)
    params = sampling_params(body, COMPLETIONS, defaults)
    if echo and params.prompt_logprobs is None and params.logprobs is not None:
        params = dataclasses.replace(params, prompt_logprobs=params.logprobs)
    params = _checked(params, body, COMPLETIONS, limits)
    _check_fan_out(len(prompts), params.n, limits.max_fan_out)
    kv_json = _kv_params(body, limits, len(prompts) * params.n)
    return CompletionRequest(
        prompts=prompts, params=params, echo=echo, kv_transfer_params_json=kv_json, **_common(body)
    )


def _image_part(part: dict[str, Any], where: str) -> ContentPart:
    """An `image_url` part: {"image_url": {"url": ...}} (or the URL as a plain string)."""
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str) or not url:
        raise InvalidRequest(f"{where}: `image_url` needs a `url` string", where)
    return ContentPart(image=ImageInput(where=where, url=url))


def _content(value: Any, where: str) -> ChatTurn:
    """A message's content: a string, or text and `image_url` parts (images need a
    multimodal model; the InputProcessor refuses them otherwise)."""
    if value is None:
        return ChatTurn("", "")
    if isinstance(value, str):
        return ChatTurn("", value)
    parts = []
    for j, part in enumerate(as_list(value, where)):
        kind = as_object(part, f"{where}[{j}]").get("type")
        if kind == "text":
            parts.append(ContentPart(text=read(part, "text", as_str, "", f"{where}[{j}]")))
        elif kind == "image_url":
            parts.append(_image_part(part, f"{where}[{j}].image_url"))
        elif kind in MEDIA_PARTS:
            raise InvalidRequest(
                f"{where}: `{kind}` content parts are not supported; send images as "
                "`image_url` parts with data: URLs",
                f"{where}[{j}]",
            )
        else:
            kind_text = shorten(str(kind))
            raise InvalidRequest(f"{where}: unknown content part type {kind_text!r}", where)
    turn = ChatTurn("", "", tuple(parts))
    return turn if turn.images else ChatTurn("", turn.text)


def chat_turns(value: Any) -> tuple[ChatTurn, ...]:
    turns = []
    for i, message in enumerate(as_list(value, "messages")):
        where = f"messages[{i}]"
        message = as_object(message, where)
        role = read(message, "role", as_str, None, where)
        if role is None:
            raise InvalidRequest(f"{where} has no `role`", where)
        content = _content(message.get("content"), f"{where}.content")
        extra = turn_fields(message, where)
        turns.append(ChatTurn(role, content.content, content.parts, **extra))
    if not turns:
        raise InvalidRequest("`messages` is empty; send at least one message", "messages")
    return tuple(turns)


def parse_chat(
    body: dict[str, Any],
    limits: RequestLimits,
    defaults: Mapping[str, Any] | None = None,
    can_choose_tools: bool = False,
) -> ChatRequest:
    """A /v1/chat/completions body, checked against `limits`; `defaults` are the model's
    sampling defaults; `can_choose_tools`: the server parses tool calls (tools.parse_tools)."""
    _refuse_unsupported(body, limits, also=("echo",))
    if body.get("messages") is None:
        raise InvalidRequest("`messages` is required", "messages")
    tools = parse_tools(body, can_choose_tools)
    prompt = PromptInput(
        chat=chat_turns(body["messages"]),
        add_generation_prompt=read(body, "add_generation_prompt", as_bool, True),
        continue_final_message=read(body, "continue_final_message", as_bool, False),
        chat_template_kwargs=read(body, "chat_template_kwargs", as_object),
    )
    top_logprobs = read(body, "top_logprobs", as_int)
    wants_logprobs = read(body, "logprobs", as_bool, False)
    if top_logprobs is not None and not wants_logprobs:
        raise InvalidRequest("`top_logprobs` needs `logprobs: true`", "top_logprobs")
    logprobs = (top_logprobs or 0) if wants_logprobs else None
    params = _checked(sampling_params(body, CHAT, defaults, logprobs=logprobs), body, CHAT, limits)
    _check_fan_out(1, params.n, limits.max_fan_out)
    common = _common(body)
    include_reasoning = read(body, "include_reasoning", as_bool, True)
    return ChatRequest(
        prompt=prompt,
        params=params,
        tools=tools,
        include_reasoning=include_reasoning,
        kv_transfer_params_json=_kv_params(body, limits, params.n),
        **common,
    )

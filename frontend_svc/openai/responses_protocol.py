"""The /v1/responses request (OpenAI's Responses API) read as a chat request: `input` items and
`instructions` become chat messages (after the stored conversation of `previous_response_id`),
flat function tools become chat tools, `text.format` the response format, `max_output_tokens`
max_tokens; the chat parser then checks everything once (errors renamed to the Responses
fields). Also the output items the answer becomes."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from frontend_svc.errors import InvalidRequest
from frontend_svc.openai.fields import as_bool, as_list, as_object, as_str, read
from frontend_svc.openai.sampling_map import CHAT

CHAT_FIELDS = (
    "model", "parallel_tool_calls", "chat_template_kwargs", "structured_outputs", "priority",
    "cache_salt", "include_reasoning", "request_id",
)  # fmt: skip
"""The chat request's fields besides sampling that mean the same here (vLLM's extras included)."""
NOT_SAMPLED = ("n", "prompt_logprobs")
"""Sampling fields that shape the chat answer rather than its tokens, which a response has no
place for (one answer; no prompt logprobs): not passed."""
REFUSED = {
    "conversation": "send previous_response_id, or the earlier items in `input`",
    "prompt": "prompt templates are not supported; send `input`",
}
RENAMED = (("max_tokens", "max_output_tokens"), ("response_format", "text.format"))
"""Chat fields that have a name of their own here (read from that name only)."""
PASSED_THROUGH = CHAT_FIELDS + tuple(
    name for name in CHAT.by_own_name() if name not in NOT_SAMPLED and name not in dict(RENAMED)
)
"""Fields passed to the chat request as sent: the sampling knobs the chat API reads by name (a
knob added to the contract is accepted here too), and CHAT_FIELDS."""


@dataclass
class ResponsesRequest:
    body: dict[str, Any]
    """The request as sent (echoed in the response object)."""
    chat_body: dict[str, Any]
    """The same request as a chat completions body."""
    new_messages: list[dict[str, Any]] = field(default_factory=list)
    """The messages this request adds (instructions excluded: they do not carry over)."""
    is_stream: bool = False
    is_stored: bool = True
    is_background: bool = False
    previous_response_id: str | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def parse_responses(body: dict[str, Any]) -> ResponsesRequest:
    """Read a /v1/responses body (the stored history is added by the caller)."""
    for name, hint in REFUSED.items():
        if body.get(name) is not None:
            raise InvalidRequest(f"`{name}` is not supported: {hint}", name)
    if body.get("input") is None:
        raise InvalidRequest("`input` is required", "input")
    is_background = read(body, "background", as_bool, False)
    is_stored = read(body, "store", as_bool, True)
    if is_background and not is_stored:
        raise InvalidRequest("`background: true` needs `store: true`", "background")
    chat: dict[str, Any] = {k: body[k] for k in PASSED_THROUGH if body.get(k) is not None}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"] = [
            _tool(t, f"tools[{i}]") for i, t in enumerate(as_list(body["tools"], "tools"))
        ]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    text_format = as_object(body.get("text") or {}, "text").get("format")
    if text_format is not None:
        chat["response_format"] = _format(as_object(text_format, "text.format"))
    return ResponsesRequest(
        body,
        chat,
        input_messages(body["input"]),
        is_stream=read(body, "stream", as_bool, False),
        is_stored=is_stored,
        is_background=is_background,
        previous_response_id=read(body, "previous_response_id", as_str),
    )


def instructions_message(body: dict[str, Any]) -> list[dict[str, Any]]:
    text = read(body, "instructions", as_str)
    return [{"role": "system", "content": text}] if text else []


def renamed(err: InvalidRequest) -> InvalidRequest:
    """A chat parser's refusal with the Responses API's field names."""
    param = err.param or ""
    for chat_name, name in RENAMED:
        if param == chat_name:
            param = name
    if param.startswith("tools[") and ".function." in param:
        param = param.replace(".function.", ".", 1)
    if param.startswith("messages"):
        param = "input" + param[len("messages") :]
    out = InvalidRequest(str(err).replace(".function.", "."), param or None)
    out.http_status, out.error_type = err.http_status, err.error_type
    return out


def _tool(value: Any, where: str) -> dict[str, Any]:
    tool = as_object(value, where)
    kind = tool.get("type")
    if kind != "function":
        raise InvalidRequest(
            f"`{where}.type` {kind!r} is not supported: only function tools are", f"{where}.type"
        )
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _tool_choice(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") == "function" and "name" in value:
        return {"type": "function", "function": {"name": value["name"]}}
    return value


def _format(spec: dict[str, Any]) -> dict[str, Any]:
    if spec.get("type") == "json_schema":
        inner = {k: spec[k] for k in ("name", "schema", "strict", "description") if k in spec}
        return {"type": "json_schema", "json_schema": inner}
    return spec


def input_messages(value: Any) -> list[dict[str, Any]]:
    """`input` (a string, or message, function_call and function_call_output items) as chat
    messages; consecutive function calls become one assistant turn."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    for i, raw in enumerate(as_list(value, "input")):
        where = f"input[{i}]"
        item = as_object(raw, where)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = {
                "id": read(item, "call_id", as_str, "", where),
                "type": "function",
                "function": {
                    "name": read(item, "name", as_str, "", where),
                    "arguments": read(item, "arguments", as_str, "{}", where),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text(output, f"{where}.output")
            call_id = read(item, "call_id", as_str, "", where)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
        elif kind == "reasoning":
            continue  # earlier thinking is not shown to the model again
        else:
            raise InvalidRequest(f"`{where}.type` {kind!r} is not supported", f"{where}.type")
    return messages


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = read(item, "role", as_str, None, where)
    if role not in ("user", "system", "developer", "assistant"):
        raise InvalidRequest(f"`{where}.role` must be user, system, developer or assistant", where)
    content = item.get("content")
    if isinstance(content, str):
        return {"role": "system" if role == "developer" else role, "content": content}
    parts = []
    for j, part in enumerate(as_list(content, f"{where}.content")):
        part = as_object(part, f"{where}.content[{j}]")
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": read(part, "text", as_str, "", where)})
        elif kind == "input_image":
            parts.append({"type": "image_url", "image_url": {"url": part.get("image_url")}})
        else:
            raise InvalidRequest(
                f"`{where}.content[{j}].type` {kind!r} is not supported", f"{where}.content[{j}]"
            )
    return {"role": "system" if role == "developer" else role, "content": parts}


def _text(value: Any, where: str) -> str:
    parts = as_list(value, where)
    return "".join(str(p.get("text", "")) for p in parts if isinstance(p, dict))


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat answer's message as Responses output items: reasoning, message, calls."""
    items: list[dict[str, Any]] = []
    if message.get("reasoning"):
        items.append(reasoning_item(new_id("rs"), message["reasoning"]))
    if message.get("content"):
        items.append(message_item(new_id("msg"), message["content"]))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        items.append(call_item(new_id("fc"), call["id"], function["name"], function["arguments"]))
    return items


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [output_text(text)] if status == "completed" else [],
    }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def conversation_tail(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An answer's output items as the chat messages a follow-up continues from."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in items:
        if item["type"] == "message":
            message["content"] += "".join(p["text"] for p in item["content"])
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function"}
            call["function"] = {"name": item["name"], "arguments": item["arguments"]}
            message.setdefault("tool_calls", []).append(call)
    return [message]

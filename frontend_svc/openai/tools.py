"""A chat request's tools: `tools`, `tool_choice` and `parallel_tool_calls` read and checked
(each refusal a 400 naming the field, as vLLM's checks say it), and the grammar that forces
`required` and named choices (vLLM's `_get_json_schema_from_tool`), so that even a weak model
answers with valid calls. Both APIs read tools through here (gRPC converts its fields to the
same JSON shapes first).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from frontend_svc.errors import InvalidRequest
from frontend_svc.openai.fields import as_bool, as_list, as_object, as_str, read
from frontend_svc.requests import ToolCallInput
from splitserve_contracts.structured_outputs import StructuredOutputsParams

MAX_TOOLS = 128
"""OpenAI's limit on tools per request."""
NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
"""Function names as OpenAI takes them (letters, digits, `_`, `-`; `.` and `:` for MCP tools)."""
CHOICES = ("none", "auto", "required")
AUTO_NEEDS_FLAGS = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)


@dataclass(frozen=True, slots=True)
class ToolsRequest:
    tools: tuple[dict[str, Any], ...]
    """{"type": "function", "function": {name, description, parameters}} each, as the chat
    template gets them."""
    choice: str
    """none | auto | required | function (a named function)."""
    function: str = ""
    """The named function, when choice is `function`."""
    is_parallel: bool = True

    def is_strict(self, names: list[str]) -> bool:
        """Whether every named tool says `strict: true` (OpenAI's strict function calling:
        objects take only the properties their schema lists)."""
        strict = {t["function"]["name"]: t["function"].get("strict") is True for t in self.tools}
        return all(strict[name] for name in names)

    @property
    def schemas(self) -> dict[str, dict[str, Any]]:
        """Tool name -> its parameters' schema."""
        return {t["function"]["name"]: t["function"].get("parameters") or {} for t in self.tools}


def parse_tools(body: dict[str, Any], can_choose: bool) -> ToolsRequest | None:
    """The request's tools (None: no tools, or `tool_choice: none` without any);
    `can_choose`: the server parses calls from free text (--enable-auto-tool-choice with a
    --tool-call-parser), which `auto` needs."""
    raw_tools = body.get("tools")
    choice, function = _choice(body.get("tool_choice"))
    if raw_tools is None:
        if choice not in (None, "none"):
            raise InvalidRequest("When using `tool_choice`, `tools` must be set.", "tool_choice")
        return None
    tools = _tools(raw_tools)
    choice = choice or "auto"
    if choice == "function" and function not in {t["function"]["name"] for t in tools}:
        raise InvalidRequest(
            f"The tool specified in `tool_choice` ({function!r}) does not match any of the "
            "specified `tools`",
            "tool_choice",
        )
    if choice == "auto" and not can_choose:
        raise InvalidRequest(AUTO_NEEDS_FLAGS, "tool_choice")
    is_parallel = read(body, "parallel_tool_calls", as_bool, True)
    return ToolsRequest(tools, choice, function, is_parallel)


def grpc_tools(body: dict[str, Any] | None, can_choose: bool) -> ToolsRequest | None:
    """The gRPC API's tool fields (converted to these JSON shapes) checked by the same rules,
    refusals naming its fields (`tools[0].parameters_json`, not `tools[0].function...`)."""
    if body is None:
        return None
    try:
        return parse_tools(body, can_choose)
    except InvalidRequest as err:
        param, message = (
            text.replace(".function.", ".").replace(".parameters", ".parameters_json")
            for text in (err.param or "", str(err))
        )
        raise InvalidRequest(message, param or None) from None


def _choice(value: Any) -> tuple[str | None, str]:
    if value is None:
        return None, ""
    if isinstance(value, str):
        if value not in CHOICES:
            raise InvalidRequest(
                f'Invalid value for `tool_choice`: {value!r}! Only named tools, "none", '
                '"auto" or "required" are supported.',
                "tool_choice",
            )
        return value, ""
    spec = as_object(value, "tool_choice")
    if spec.get("type", "function") != "function":
        raise InvalidRequest(
            '`tool_choice.type` must be "function" (allowed_tools and custom tools are not '
            "supported)",
            "tool_choice.type",
        )
    function = spec.get("function")
    if not isinstance(function, dict):
        raise InvalidRequest(
            '`tool_choice` names a function as {"type": "function", "function": {"name": '
            '"my_function"}}',
            "tool_choice.function",
        )
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest(
            "`tool_choice.function.name` must be a non-empty string", "tool_choice.function.name"
        )
    return "function", name


def _tools(value: Any) -> tuple[dict[str, Any], ...]:
    items = as_list(value, "tools")
    if not items:
        raise InvalidRequest(
            "`tools` must not be an empty array. Either provide at least one tool or omit the "
            "field entirely.",
            "tools",
        )
    if len(items) > MAX_TOOLS:
        raise InvalidRequest(f"`tools` has {len(items)} tools; at most {MAX_TOOLS}", "tools")
    tools: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, item in enumerate(items):
        tool = _tool(item, f"tools[{i}]")
        name = tool["function"]["name"]
        if name in seen:
            raise InvalidRequest(
                f"tools[{i}].function.name: {name!r} is defined twice", f"tools[{i}].function.name"
            )
        seen.add(name)
        tools.append(tool)
    return tuple(tools)


def _tool(item: Any, where: str) -> dict[str, Any]:
    spec = as_object(item, where)
    kind = spec.get("type", "function")
    if kind != "function":
        raise InvalidRequest(f'`{where}.type` must be "function", got {kind!r}', f"{where}.type")
    function = as_object(spec.get("function"), f"{where}.function")
    name = read(function, "name", as_str, None, f"{where}.function")
    if name is None or not NAME.fullmatch(name):
        raise InvalidRequest(
            f"`{where}.function.name` must be 1 to 64 letters, digits, `_`, `-`, `.` or `:`",
            f"{where}.function.name",
        )
    out: dict[str, Any] = {"name": name}
    description = read(function, "description", as_str, None, f"{where}.function")
    if description is not None:
        out["description"] = description
    parameters = function.get("parameters")
    if parameters is not None:
        out["parameters"] = _parameters(parameters, f"{where}.function.parameters")
    strict = read(function, "strict", as_bool, None, f"{where}.function")
    if strict is not None:
        out["strict"] = strict
    return {"type": "function", "function": out}


def _parameters(value: Any, where: str) -> dict[str, Any]:
    schema = as_object(value, where)
    kind = schema.get("type", "object")
    if kind != "object":
        raise InvalidRequest(
            f'`{where}` must be a JSON Schema of an object (type "object"), got type {kind!r}',
            where,
        )
    if "properties" in schema and not isinstance(schema["properties"], dict):
        raise InvalidRequest(f"`{where}.properties` must be an object", f"{where}.properties")
    return schema


def forced_constraint(tools: ToolsRequest) -> StructuredOutputsParams | None:
    """The grammar of a `required` or named choice (None for auto and none): the named
    function's arguments, or a JSON list of calls `[{"name": ..., "parameters": ...}]` (one
    at most when parallel_tool_calls is false)."""
    if tools.choice == "function":
        named = tools.schemas[tools.function] or {"type": "object", "properties": {}}
        is_strict = tools.is_strict([tools.function])
        return StructuredOutputsParams(
            json=json.dumps(named), disable_additional_properties=is_strict
        )
    if tools.choice != "required":
        return None
    defs: dict[str, Any] = {}
    branches = []
    for name, parameters in tools.schemas.items():
        parameters = dict(parameters or {"type": "object", "properties": {}})
        for key, definition in parameters.pop("$defs", {}).items():
            if defs.setdefault(key, definition) != definition:
                raise InvalidRequest(
                    f"tool definitions give `$defs.{key}` different schemas, which is not "
                    "supported with tool_choice required",
                    "tools",
                )
        branches.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not tools.is_parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    is_strict = tools.is_strict(list(tools.schemas))
    return StructuredOutputsParams(json=json.dumps(schema), disable_additional_properties=is_strict)


def turn_fields(message: dict[str, Any], where: str) -> dict[str, Any]:
    """A message's fields besides role and content (ChatTurn's): an assistant's `tool_calls`
    (arguments JSON text, given to the template as an object, as vLLM does) and `reasoning`
    (or the older `reasoning_content`), a tool message's `tool_call_id`, and `name`."""
    fields: dict[str, Any] = {}
    calls = message.get("tool_calls")
    if calls is not None:
        fields["tool_calls"] = tuple(
            _tool_call(call, f"{where}.tool_calls[{j}]")
            for j, call in enumerate(as_list(calls, f"{where}.tool_calls"))
        )
    for key, name in (("tool_call_id", "tool_call_id"), ("name", "name")):
        value = read(message, key, as_str, None, where)
        if value is not None:
            fields[name] = value
    reasoning = read(message, "reasoning", as_str, None, where)
    if reasoning is None:
        reasoning = read(message, "reasoning_content", as_str, None, where)
    if reasoning is not None:
        fields["reasoning"] = reasoning
    return fields


def _tool_call(value: Any, where: str) -> ToolCallInput:
    call = as_object(value, where)
    function = as_object(call.get("function"), f"{where}.function")
    name = read(function, "name", as_str, None, f"{where}.function")
    if not name:
        raise InvalidRequest(f"`{where}.function.name` is required", f"{where}.function.name")
    raw = function.get("arguments", "{}")
    arguments: Any = raw
    if isinstance(raw, str):
        try:
            arguments = json.loads(raw or "{}")
        except ValueError as err:
            raise InvalidRequest(
                f"`{where}.function.arguments` is not valid JSON: {err}",
                f"{where}.function.arguments",
            ) from None
    if not isinstance(arguments, dict):
        raise InvalidRequest(
            f"`{where}.function.arguments` must be a JSON object", f"{where}.function.arguments"
        )
    return ToolCallInput(read(call, "id", as_str, "", where), name, arguments)

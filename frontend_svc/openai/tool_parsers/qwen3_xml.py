"""`qwen3_xml` / `qwen3_coder` (vLLM's Qwen3 tool parser, both names): Qwen3-Coder, Qwen3.5 and
others that write calls as XML-like tags:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Parameter values are text, converted by the type the tool's schema gives the parameter
(integer, number, boolean, object, array, null), strings kept as written, as vLLM converts
them. The arguments grow one complete parameter at a time: `{`, then `{"city": "Paris"`, ...,
then the closing `}` with `</function>`.
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Mapping
from typing import Any

from frontend_svc.openai.tool_parsers.base import (
    CallDraft,
    Parsed,
    ToolParser,
    dumps,
    held_back,
)

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"


class Qwen3XmlToolParser(ToolParser):
    markers = (START, END)

    def parse(self, text: str, is_final: bool) -> Parsed:
        first = text.find(START)
        if first < 0:
            return Parsed(held_back(text, (START,), is_final))
        calls: list[CallDraft] = []
        pos = first
        while pos >= 0:
            body = pos + len(START)
            close = text.find(END, body)
            segment = text[body : close if close >= 0 else len(text)]
            calls.append(self._call(segment, is_final or close >= 0))
            if close < 0:
                break
            pos = text.find(START, close + len(END))
        return Parsed(text[:first], tuple(calls))

    def _call(self, segment: str, is_closed: bool) -> CallDraft:
        at = segment.find(FUNCTION)
        name_end = segment.find(">", at) if at >= 0 else -1
        if name_end < 0:
            return CallDraft(None, "", is_closed)
        name = segment[at + len(FUNCTION) : name_end].strip()
        schema = _properties(self.tools.get(name, {}))
        function_end = segment.find(FUNCTION_END, name_end)
        body = segment[name_end + 1 : function_end if function_end >= 0 else len(segment)]
        is_done = function_end >= 0 or is_closed
        pieces = [
            f"{dumps(key)}: {dumps(_convert(value, schema.get(key)))}"
            for key, value in _parameters(body, is_done)
        ]
        arguments = "{" + ", ".join(pieces) + ("}" if is_done else "")
        return CallDraft(name or None, arguments, is_done)


def _parameters(body: str, is_done: bool) -> list[tuple[str, str]]:
    """The complete `<parameter=key>value</parameter>` pairs of a function body (a parameter
    left open is complete when the next one or the function's end follows, as vLLM reads
    it)."""
    found: list[tuple[str, str]] = []
    pos = body.find(PARAMETER)
    while pos >= 0:
        key_end = body.find(">", pos)
        if key_end < 0:
            break
        key = body[pos + len(PARAMETER) : key_end].strip()
        close = body.find(PARAMETER_END, key_end)
        following = body.find(PARAMETER, key_end)
        if close < 0 or 0 <= following < close:
            close = following
        if close < 0 and not is_done:
            break
        value = body[key_end + 1 : close if close >= 0 else len(body)]
        found.append((key, _trim(value)))
        pos = body.find(PARAMETER, close) if close >= 0 else -1
    return found


def _trim(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    return value[:-1] if value.endswith("\n") else value


def _properties(parameters: Mapping[str, Any]) -> Mapping[str, Any]:
    props = parameters.get("properties") if isinstance(parameters, Mapping) else None
    return props if isinstance(props, Mapping) else {}


def _type_of(schema: Any) -> str:
    if not isinstance(schema, Mapping):
        return "string"
    kind = schema.get("type", "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if "enum" in schema and "type" not in schema:
        return "string"
    return str(kind).lower()


def _convert(value: str, schema: Any) -> Any:
    """A parameter's text as the JSON value its schema's type says (the text when it does not
    parse as that type)."""
    if value.strip().lower() == "null":
        return None
    kind = _type_of(schema)
    try:
        if kind in ("string", "str", "text"):
            return value
        if kind in ("integer", "int"):
            return int(value.strip())
        if kind in ("number", "float"):
            number = float(value.strip())
            if not math.isfinite(number):
                return value
            return int(number) if number.is_integer() and "." not in value else number
        if kind in ("boolean", "bool"):
            lowered = value.strip().lower()
            return lowered == "true" if lowered in ("true", "false") else value
        return json.loads(value)
    except ValueError:
        pass
    try:
        return ast.literal_eval(value.strip())
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return value

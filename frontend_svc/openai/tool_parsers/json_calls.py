"""Tool calls written as JSON objects, `{"name": ..., "arguments": {...}}`, read from text that
may stop anywhere (hermes, llama3_json, mistral and the forced `required` form share this).

The arguments are the model's own JSON text (checked to parse when the call completes), not a
re-serialization: streaming can then send them as they are generated and the pieces add up to
the final arguments exactly. Complete values are found by the standard library's JSON decoder
(`raw_decode`); only where a value is still open does this module decide that it is open.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from frontend_svc.openai.tool_parsers.base import CallDraft

_DECODER = json.JSONDecoder()
_WS = " \t\r\n"
ARGUMENT_KEYS = ("arguments", "parameters")
"""Where a call's arguments are: Hermes and OpenAI say `arguments`, Llama 3 and vLLM's forced
form say `parameters`."""


@dataclass(frozen=True, slots=True)
class Member:
    key: str
    start: int
    """Where the value starts in the text."""
    end: int | None
    """Where it ends; None while it is still being written."""


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def value_end(text: str, start: int, is_final: bool) -> int | None:
    """The end of the JSON value at `start`, or None when it is not complete (a number or
    literal that reaches the end of an unfinished text may still grow)."""
    try:
        _, end = _DECODER.raw_decode(text, start)
    except ValueError:
        return None
    if end == len(text) and not is_final and text[start] not in '{["':
        return None
    return end


def object_members(text: str, start: int, is_final: bool) -> tuple[list[Member], int | None]:
    """The members of the JSON object whose `{` is at `start`, as far as the text goes, and
    the object's end (None: not closed, or not an object)."""
    members: list[Member] = []
    pos = start + 1
    while True:
        pos = skip_ws(text, pos)
        if pos >= len(text):
            return members, None
        if text[pos] == "}":
            return members, pos + 1
        if text[pos] == ",":
            pos += 1
            continue
        key_end = value_end(text, pos, True) if text[pos] == '"' else None
        if key_end is None:
            return members, None
        key = json.loads(text[pos:key_end])
        pos = skip_ws(text, key_end)
        if pos >= len(text) or text[pos] != ":":
            return members, None
        pos = skip_ws(text, pos + 1)
        if pos >= len(text):
            return members, None
        end = value_end(text, pos, is_final)
        members.append(Member(key, pos, end))
        if end is None:
            return members, None
        pos = end


def json_call(text: str, start: int, is_final: bool) -> tuple[CallDraft | None, int | None]:
    """The call written as a JSON object at `start` (whitespace before it skipped) and the
    object's end; (None, None) when the text there is not (yet) an object."""
    pos = skip_ws(text, start)
    if pos >= len(text) or text[pos] != "{":
        return None, None
    members, end = object_members(text, pos, is_final)
    name: str | None = None
    arguments = ""
    for member in members:
        if member.key == "name" and member.end is not None:
            value = json.loads(text[member.start : member.end])
            name = value if isinstance(value, str) else None
        elif member.key in ARGUMENT_KEYS:
            arguments = _arguments(text, member)
    return CallDraft(name, arguments, end is not None), end


def _arguments(text: str, member: Member) -> str:
    """The arguments' text so far. A string value (arguments sent as JSON-in-a-string) counts
    once complete, decoded."""
    if text[member.start] == '"':
        if member.end is None:
            return ""
        decoded = json.loads(text[member.start : member.end])
        return decoded if isinstance(decoded, str) else ""
    return text[member.start : member.end if member.end is not None else len(text)].rstrip(_WS)


def json_list(text: str, pos: int, is_final: bool) -> tuple[CallDraft, ...]:
    """The calls of a JSON list of call objects whose `[` is at `pos`, as far as they go."""
    calls: list[CallDraft] = []
    pos += 1
    while True:
        pos = skip_ws(text, pos)
        if pos >= len(text) or text[pos] == "]":
            return tuple(calls)
        if text[pos] == ",":
            pos += 1
            continue
        call, end = json_call(text, pos, is_final)
        if call is None:
            return tuple(calls)
        calls.append(call)
        if end is None:
            return tuple(calls)
        pos = end

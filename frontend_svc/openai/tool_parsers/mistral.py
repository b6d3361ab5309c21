"""`mistral` (vLLM's MistralToolParser): Mistral 7B v0.3, Mixtral, Mistral Small/Nemo/Large,
Magistral, Devstral. Calls follow the `[TOOL_CALLS]` token, as a JSON list (tokenizers before
v11)

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]

or one call per token (v11 and later)

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]...

Content is the text before the first `[TOOL_CALLS]`. Call ids are 9 letters and digits, the
only form Mistral's chat templates accept back.
"""

from __future__ import annotations

from frontend_svc.openai.tool_parsers.base import CallDraft, Parsed, ToolParser, held_back
from frontend_svc.openai.tool_parsers.json_calls import json_list, skip_ws, value_end

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


class MistralToolParser(ToolParser):
    markers = (TOOL_CALLS, ARGS, CALL_ID)
    id_style = "mistral"

    def parse(self, text: str, is_final: bool) -> Parsed:
        first = text.find(TOOL_CALLS)
        if first < 0:
            return Parsed(held_back(text, (TOOL_CALLS,), is_final))
        pos = skip_ws(text, first + len(TOOL_CALLS))
        if pos < len(text) and text[pos] == "[":
            return Parsed(text[:first], json_list(text, pos, is_final))
        calls: list[CallDraft] = []
        start = first
        while start >= 0:
            body = start + len(TOOL_CALLS)
            following = text.find(TOOL_CALLS, body)
            segment = text[body : following if following >= 0 else len(text)]
            calls.append(_named_call(segment, is_final or following >= 0))
            start = following
        return Parsed(text[:first], tuple(calls))


def _named_call(segment: str, is_closed: bool) -> CallDraft:
    """`name[ARGS]{...}` (a `[CALL_ID]id` after the name is skipped)."""
    args_at = segment.find(ARGS)
    if args_at < 0:
        return CallDraft(None, "", is_closed)
    name = segment[:args_at].split(CALL_ID)[0].strip()
    start = skip_ws(segment, args_at + len(ARGS))
    if start >= len(segment):
        return CallDraft(name or None, "", is_closed)
    end = value_end(segment, start, is_closed)
    arguments = segment[start : end if end is not None else len(segment)].rstrip()
    return CallDraft(name or None, arguments, end is not None)

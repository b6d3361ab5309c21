"""`llama3_json` / `llama4_json` (vLLM's Llama3JsonToolParser): Llama 3.1-3.3 and Llama 4 with
JSON tool calls. The whole answer is the calls, optionally after `<|python_tag|>`, separated by
semicolons:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

An answer that does not start with `{` (or the tag) is content.
"""

from __future__ import annotations

from frontend_svc.openai.tool_parsers.base import CallDraft, Parsed, ToolParser
from frontend_svc.openai.tool_parsers.json_calls import json_call, skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    markers = (PYTHON_TAG,)
    starts_anywhere = False

    def parse(self, text: str, is_final: bool) -> Parsed:
        pos = skip_ws(text, 0)
        rest = text[pos:]
        if rest.startswith(PYTHON_TAG):
            pos = skip_ws(text, pos + len(PYTHON_TAG))
        elif not is_final and PYTHON_TAG.startswith(rest):
            return Parsed("")  # empty, blanks, or the tag still arriving: undecided
        if pos >= len(text):  # blanks, or the tag alone
            return Parsed(text if is_final and not rest.startswith(PYTHON_TAG) else "")
        if text[pos] != "{":
            return Parsed(text)
        calls: list[CallDraft] = []
        while True:
            call, end = json_call(text, pos, is_final)
            if call is None:
                break
            calls.append(call)
            if end is None:
                break
            pos = skip_ws(text, end)
            if pos < len(text) and text[pos] == ";":
                pos += 1
            elif pos < len(text):
                break
        return Parsed("", tuple(calls))

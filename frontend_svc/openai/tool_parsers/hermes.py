"""`hermes` (vLLM's Hermes2ProToolParser): Hermes 2/3, Qwen2.5, Qwen3 (non-coder) and other
models trained on the Hermes function-calling format:

    text before <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {...}
    </tool_call>

Content is the text before the first `<tool_call>` (vLLM drops text between and after calls).
"""

from __future__ import annotations

from frontend_svc.openai.tool_parsers.base import CallDraft, Parsed, ToolParser, held_back
from frontend_svc.openai.tool_parsers.json_calls import json_call

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
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
            call, _ = json_call(segment, 0, is_final or close >= 0)
            calls.append(call or CallDraft(None, "", close >= 0 or is_final))
            if close < 0:
                break
            pos = text.find(START, close + len(END))
        return Parsed(text[:first], tuple(calls))

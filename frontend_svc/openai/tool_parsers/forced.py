"""The answers a grammar forces when `tool_choice` is `required` or names a function (vLLM's
forms, so that any model returns valid calls whatever its own format):

- `required`: a JSON list of calls, `[{"name": "get_weather", "parameters": {...}}, ...]`
  (at least one; exactly one when `parallel_tool_calls` is false);
- a named function: the answer is that function's arguments, a JSON object.
"""

from __future__ import annotations

from frontend_svc.openai.tool_parsers.base import CallDraft, Parsed, ToolParser
from frontend_svc.openai.tool_parsers.json_calls import json_list


class RequiredToolParser(ToolParser):
    starts_anywhere = False

    def parse(self, text: str, is_final: bool) -> Parsed:
        start = text.find("[")
        if start < 0:
            return Parsed("")
        return Parsed("", json_list(text, start, is_final))


class NamedToolParser(ToolParser):
    starts_anywhere = False

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def parse(self, text: str, is_final: bool) -> Parsed:
        arguments = text.strip() if is_final else text.lstrip()
        return Parsed("", (CallDraft(self.name, arguments.rstrip(), is_final),))

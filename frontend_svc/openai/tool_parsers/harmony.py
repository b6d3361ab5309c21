"""`openai` (vLLM's OpenAIToolParser): gpt-oss's tool calls in the harmony format.

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

Each message addressed `to=functions.NAME` (on any channel; the recipient may also stand before
`<|channel|>`) is a call of NAME, its text the arguments; the `final` channel is the content.
Reasoning (`analysis`) is not content: `--reasoning-parser openai_gptoss` shows it. Calls of
built-in tools (`browser.*`, `python`) are neither. Unlike the other formats, the structure
spans the whole answer, so the stream hands this parser all of the text (`reads_whole_text`).
"""

from __future__ import annotations

from typing import ClassVar

from frontend_svc.openai.harmony import MARKERS, HarmonyReader, HarmonyReading, split_reading
from frontend_svc.openai.tool_parsers.base import CallDraft, Parsed, ToolParser, ToolSchemas

FUNCTIONS = "functions."


class HarmonyToolParser(ToolParser):
    markers = MARKERS
    reads_whole_text: ClassVar[bool] = True

    def __init__(self, tools: ToolSchemas | None = None) -> None:
        super().__init__(tools)
        self._reader: HarmonyReader | None = None
        self._text = ""

    def parse(self, text: str, is_final: bool) -> Parsed:
        reading = self._read(text, is_final)
        calls = tuple(
            CallDraft(m.recipient.removeprefix(FUNCTIONS), m.text, m.is_complete)
            for m in reading.messages
            if m.recipient is not None and m.recipient.startswith(FUNCTIONS)
        )
        return Parsed(split_reading(reading)[1], calls)

    def _read(self, text: str, is_final: bool) -> HarmonyReading:
        """`text` read; the reader goes on from the last text when `text` extends it (as while
        streaming), and starts over otherwise."""
        if self._reader is None or self._reader.is_final or not text.startswith(self._text):
            self._reader, self._text = HarmonyReader(), ""
        reading = self._reader.feed(text[len(self._text) :], is_final)
        self._text = text
        return reading

"""`openai_gptoss` (vLLM's GptOssReasoningParser): gpt-oss's harmony answer split by channel.

The `analysis` messages are the reasoning and the `final` messages (and any without a channel)
the content, several of a kind one per line, as vLLM joins them; tool calls (`commentary` to
`functions.NAME`) and built-in tools' messages are neither: the `openai` tool parser reads
those from the same text.
An answer that stops being harmony (frontend_svc/openai/harmony.py) is content from there on.
"""

from __future__ import annotations

from frontend_svc.openai.harmony import HarmonyReader, split_reading


class HarmonyReasoningStream:
    """Splits a growing harmony answer: each `update` takes the text new since the last one
    and returns the new part of the reasoning and of the content. What was sent is always a
    start of what the whole answer gives, so the deltas add up to the non-streaming split."""

    def __init__(self) -> None:
        self.reader = HarmonyReader()
        self.num_reasoning_chars = 0
        self.num_content_chars = 0

    def update(self, new_text: str, is_final: bool) -> tuple[str, str]:
        reasoning, content = split_reading(self.reader.feed(new_text, is_final))
        new_reasoning = reasoning[self.num_reasoning_chars :]
        new_content = content[self.num_content_chars :]
        self.num_reasoning_chars = max(self.num_reasoning_chars, len(reasoning))
        self.num_content_chars = max(self.num_content_chars, len(content))
        return new_reasoning, new_content

"""Reasoning parsers by vLLM's `--reasoning-parser` names: the thinking a model writes between
`<think>` and `</think>` goes to the message's `reasoning` (vLLM's field) and
`reasoning_content` (DeepSeek's, which many clients read), the rest is the answer.

- `deepseek_r1`: DeepSeek-R1 and its distills. Everything before `</think>` is reasoning
  (the template may already have opened `<think>` in the prompt; a `<think>` the model writes
  first is dropped); without `</think>` the answer was cut short and all of it is reasoning.
- `qwen3`: Qwen3, QwQ. The same, and `chat_template_kwargs.enable_thinking: false` makes the
  whole answer content (Qwen3's template then closes the thinking in the prompt).

- `openai_gptoss`: gpt-oss's harmony format (reasoning/harmony.py): the `analysis` channel is
  the reasoning, the `final` channel the answer, read by openai-harmony's parser. Its end is no
  single token, so a structured-output grammar applies from the answer's first token.

With the think tokens, a prompt that already ends the reasoning (its last think token is
`</think>`, as Qwen3's template writes it with thinking off) makes the whole answer content,
and a structured-output grammar starts after `</think>` (the engine core's reasoning hook).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from frontend_svc.openai.harmony import require_harmony_encoding
from frontend_svc.openai.reasoning.harmony import HarmonyReasoningStream
from frontend_svc.openai.tool_parsers.base import held_back
from frontend_svc.requests import ReasoningTokens


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    start: str = "<think>"
    end: str = "</think>"
    honours_enable_thinking: bool = False
    is_harmony: bool = False
    """gpt-oss's channels; `start` and `end` are then only the markers it needs."""


REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "deepseek_r1": ReasoningFormat(),
    "qwen3": ReasoningFormat(honours_enable_thinking=True),
    "openai_gptoss": ReasoningFormat("<|channel|>", "<|message|>", is_harmony=True),
}
"""--reasoning-parser NAME -> its format."""


class ReasoningParser:
    """A format bound to the served tokenizer (its think tokens must be single tokens, as vLLM
    requires: the engine core recognizes the end of reasoning by its id)."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        self.name = name
        self.format = REASONING_PARSERS[name]
        vocab = tokenizer.get_vocab()
        missing = [t for t in (self.format.start, self.format.end) if t not in vocab]
        if missing:
            raise ValueError(
                f"--reasoning-parser {name} needs the tokens {self.format.start} and "
                f"{self.format.end} in the tokenizer's vocabulary; it has no {', '.join(missing)}"
            )
        self.tokens: ReasoningTokens | None = None
        """The think tokens the engine core starts a grammar after (None: harmony)."""
        if self.format.is_harmony:
            require_harmony_encoding(f"--reasoning-parser {name}")
        else:
            self.tokens = ReasoningTokens(
                vocab[self.format.start], vocab[self.format.end], self.format.start, self.format.end
            )
        special = set(getattr(tokenizer, "all_special_tokens", ()) or ())
        self.has_special_markers = bool(special & {self.format.start, self.format.end})
        """Whether the think tokens are special (then requests keep special tokens in their
        text, or the markers would vanish before they are parsed)."""

    def is_thinking(self, chat_template_kwargs: dict[str, Any] | None) -> bool:
        """Whether a request's model thinks (qwen3 honours enable_thinking: false)."""
        if not self.format.honours_enable_thinking:
            return True
        return (chat_template_kwargs or {}).get("enable_thinking", True) is not False

    def stream(self, prompt_ends_reasoning: bool, is_thinking: bool) -> AnswerSplitter:
        """The splitter of one answer: a prompt that ended the reasoning (InputProcessor
        says), or thinking off, makes it all content."""
        if self.format.is_harmony:
            return HarmonyReasoningStream()
        is_content = not is_thinking or prompt_ends_reasoning
        return ReasoningStream(self.format, "content" if is_content else "start")


class AnswerSplitter(Protocol):
    def update(self, new_text: str, is_final: bool) -> tuple[str, str]:
        """The new reasoning and the new content, given the answer's new text."""
        ...


class ReasoningStream:
    """Splits a growing answer into reasoning and content: each `update` takes the text new
    since the last one and returns the new part of each. It keeps only what it cannot decide
    yet (an end that may still become `</think>`), so a long answer costs linear time."""

    def __init__(self, fmt: ReasoningFormat, phase: str = "start") -> None:
        self.format = fmt
        self.phase = phase
        self.pending = ""

    def update(self, new_text: str, is_final: bool) -> tuple[str, str]:
        if self.phase == "content":
            return "", new_text
        text = self.pending + new_text
        start, end = self.format.start, self.format.end
        if self.phase == "start":
            lead = text.lstrip()
            if lead.startswith(start):
                text = lead[len(start) :]
            elif not is_final and start.startswith(lead):
                self.pending = text
                return "", ""  # blanks, or `<think>` still arriving
            self.phase = "reasoning"
        found = text.find(end)
        if found < 0:
            reasoning = held_back(text, (end,), is_final)
            self.pending = text[len(reasoning) :]
            return reasoning, ""
        self.phase, self.pending = "content", ""
        return text[:found], text[found + len(end) :]

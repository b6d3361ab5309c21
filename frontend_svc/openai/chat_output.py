"""How a chat answer's text becomes OpenAI's message: the thinking split off by the reasoning
parser (`reasoning`, and `reasoning_content` as DeepSeek names it), tool calls read by the
request's tool parser from what remains, the rest `content` — for a whole answer, or as
deltas while it streams."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from frontend_svc.openai.reasoning import ReasoningParser, ReasoningStream
from frontend_svc.openai.tool_parsers import TOOL_PARSERS, ToolParser
from frontend_svc.openai.tool_parsers.forced import NamedToolParser, RequiredToolParser
from frontend_svc.openai.tool_parsers.stream import ToolCallStream
from frontend_svc.openai.tools import ToolsRequest


@dataclass(frozen=True)
class ChatFeatures:
    """The server's tool and reasoning settings (--enable-auto-tool-choice,
    --tool-call-parser, --reasoning-parser), checked at start-up."""

    tool_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning: ReasoningParser | None = None
    tool_markers_are_special: bool = False
    """The tool parser's markers are special tokens of this tokenizer."""

    @property
    def can_choose_tools(self) -> bool:
        return self.enable_auto_tool_choice and self.tool_parser is not None


def tool_markers_are_special(parser_name: str | None, tokenizer: Any) -> bool:
    if parser_name is None:
        return False
    special = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    return bool(special & set(TOOL_PARSERS[parser_name].markers))


@dataclass(frozen=True)
class OutputRules:
    """How one request's answers are read."""

    features: ChatFeatures
    tools: ToolsRequest | None = None
    is_thinking: bool = True
    include_reasoning: bool = True

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the answer's text must keep special tokens (markers the parsers read)."""
        reasoning = self.features.reasoning
        uses_tools = self.tools is not None and self.tools.choice == "auto"
        return (uses_tools and self.features.tool_markers_are_special) or (
            reasoning is not None and reasoning.has_special_markers
        )

    def tool_parser(self) -> ToolParser | None:
        tools = self.tools
        if tools is None or tools.choice == "none":
            return None
        if tools.choice == "function":
            return NamedToolParser(tools.function)
        if tools.choice == "required":
            return RequiredToolParser()
        name = self.features.tool_parser
        return TOOL_PARSERS[name](tools.schemas) if name is not None else None


@dataclass
class ChoiceOutput:
    """One choice's answer as it is read; `update` with the whole text so far."""

    rules: OutputRules
    prompt_ends_reasoning: bool = False
    reasoning_stream: ReasoningStream | None = None
    tool_stream: ToolCallStream | None = None
    content: str = ""
    """The content so far (what the tool parser reads)."""
    num_text_chars: int = 0
    has_calls: bool = False

    def __post_init__(self) -> None:
        reasoning = self.rules.features.reasoning
        if reasoning is not None:
            self.reasoning_stream = reasoning.stream(
                self.prompt_ends_reasoning, self.rules.is_thinking
            )
        parser = self.rules.tool_parser()
        if parser is not None:
            tools = self.rules.tools
            is_single = tools is not None and not tools.is_parallel
            self.tool_stream = ToolCallStream(parser, 1 if is_single else 1 << 30)

    def update(self, text: str, is_final: bool) -> dict[str, Any]:
        """The stream delta's fields new since the last update (empty: nothing to send)."""
        reasoning, content = self._split(text, is_final)
        if self.reasoning_stream is None and self.tool_stream is None:
            return {"content": content}  # plain text: one chunk per delta, as before parsing
        delta: dict[str, Any] = {}
        if reasoning and self.rules.include_reasoning:
            delta["reasoning"] = delta["reasoning_content"] = reasoning
        if self.tool_stream is not None:
            self.content += content
            content, calls = self.tool_stream.update(self.content, is_final)
            if calls:
                delta["tool_calls"] = calls
                self.has_calls = True
        if content:
            delta["content"] = content
        return delta

    def _split(self, text: str, is_final: bool) -> tuple[str, str]:
        if self.reasoning_stream is None:
            new = text[self.num_text_chars :]
            self.num_text_chars = len(text)
            return "", new
        return self.reasoning_stream.update(text, is_final)

    def message(self, text: str) -> dict[str, Any]:
        """The whole answer's message (vLLM's: a malformed call leaves the text as content)."""
        reasoning: str | None = None
        content = text
        if self.reasoning_stream is not None:
            reasoning, content = self.reasoning_stream.update(text, is_final=True)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        parser = self.rules.tool_parser()
        if parser is not None and self.tool_stream is not None:
            content, drafts = parser.extract(content)
            calls = self.tool_stream.finished_calls(drafts[: self.tool_stream.max_calls])
            if calls:
                self.has_calls = True
                message["tool_calls"] = [call.to_openai() for call in calls]
            message["content"] = content or None if calls else content
        if self.rules.features.reasoning is not None:
            message["content"] = message["content"] or None  # all of it was thinking
            shown = (reasoning or None) if self.rules.include_reasoning else None
            message["reasoning"] = message["reasoning_content"] = shown
        return message

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """`tool_calls` when the model stopped after calling tools (not for a named choice,
        as OpenAI answers), else the engine's reason."""
        tools = self.rules.tools
        is_named = tools is not None and tools.choice == "function"
        if self.has_calls and not is_named and engine_reason == "stop":
            return "tool_calls"
        return engine_reason

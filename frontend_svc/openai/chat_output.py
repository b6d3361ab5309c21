"""How a chat answer's text becomes OpenAI's message: the thinking split off by the reasoning
parser (`reasoning`, and `reasoning_content` as DeepSeek names it), tool calls read by the
request's tool parser from what remains, the rest `content` — for a whole answer, or as
deltas while it streams."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from frontend_svc.errors import InvalidRequest
from frontend_svc.openai.reasoning import AnswerSplitter, ReasoningParser
from frontend_svc.openai.tool_parsers import TOOL_PARSERS, ToolCall, ToolParser
from frontend_svc.openai.tool_parsers.forced import NamedToolParser, RequiredToolParser
from frontend_svc.openai.tool_parsers.stream import ToolCallStream
from frontend_svc.openai.tools import ToolsRequest, forced_constraint
from frontend_svc.requests import CompletionDelta, GenerateInput


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
    def is_plain(self) -> bool:
        """No reasoning parser and no tools: the answer is its text."""
        return self.features.reasoning is None and self.tools is None

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


def prepare_chat_call(
    call: GenerateInput,
    tools: ToolsRequest | None,
    features: ChatFeatures,
    include_reasoning: bool = True,
) -> tuple[GenerateInput, OutputRules]:
    """A chat call with its tools applied (shown to the template; a required or named
    choice's grammar; special tokens kept where the parsers read them; the reasoning tokens
    that start a grammar late) and the rules that read its answers. Both APIs use it."""
    reasoning = features.reasoning if call.prompt.chat is not None else None
    kwargs = call.prompt.chat_template_kwargs
    is_thinking = reasoning is not None and reasoning.is_thinking(kwargs)
    rules = OutputRules(features, tools, is_thinking, include_reasoning)
    if rules.is_plain:
        return call, rules
    forced = forced_constraint(tools) if tools is not None else None
    constraint, where = call.structured_outputs, call.structured_outputs_field
    if forced is not None:
        if constraint is not None:
            raise InvalidRequest(
                "You can only either use constraints for structured outputs or tools, not both "
                f"(`{where}` and tool_choice {tools.choice!r})",  # type: ignore[union-attr]
                "tool_choice",
            )
        constraint, where = forced, "tools"
    params = call.params
    if rules.keeps_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)
    prompt = call.prompt
    if tools is not None:
        prompt = dataclasses.replace(prompt, tools=tools.tools)
    tokens = reasoning.tokens if reasoning is not None and is_thinking else None
    prepared = dataclasses.replace(
        call, prompt=prompt, params=params, structured_outputs=constraint,
        structured_outputs_field=where, reasoning=tokens,
    )  # fmt: skip
    return prepared, rules


@dataclass
class ChoiceOutput:
    """One choice's answer as it is read; `update` with the whole text so far."""

    rules: OutputRules
    prompt_ends_reasoning: bool = False
    reasoning_stream: AnswerSplitter | None = None
    tool_stream: ToolCallStream | None = None
    has_calls: bool = False
    streamed_calls: list[ToolCall] = field(default_factory=list)
    """The calls the stream sent so far, put together."""

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

    def update(self, new_text: str, is_final: bool) -> dict[str, Any]:
        """The stream delta's fields for the answer's text new since the last update
        (empty: nothing to send yet)."""
        reasoning, content = self._split(new_text, is_final)
        if self.reasoning_stream is None and self.tool_stream is None:
            return {"content": content}  # plain text: one chunk per delta, as before parsing
        delta: dict[str, Any] = {}
        if reasoning and self.rules.include_reasoning:
            delta["reasoning"] = delta["reasoning_content"] = reasoning
        if self.tool_stream is not None:
            whole = self.tool_stream.parser.reads_whole_text
            content, calls = self.tool_stream.update(new_text if whole else content, is_final)
            if calls:
                delta["tool_calls"] = calls
                self.has_calls = True
                self._collect(calls)
        if content:
            delta["content"] = content
        return delta

    def _collect(self, deltas: list[dict[str, Any]]) -> None:
        for delta in deltas:
            function = delta["function"]
            if "id" in delta:
                self.streamed_calls.append(ToolCall(delta["id"], function["name"], ""))
            call = self.streamed_calls[delta["index"]]
            call.arguments += function.get("arguments", "")

    def _split(self, new_text: str, is_final: bool) -> tuple[str, str]:
        if self.reasoning_stream is None:
            return "", new_text
        return self.reasoning_stream.update(new_text, is_final)

    def message(self, text: str) -> dict[str, Any]:
        """The whole answer's message (vLLM's: a malformed call leaves the text as content)."""
        reasoning: str | None = None
        content = text
        if self.reasoning_stream is not None:
            reasoning, content = self.reasoning_stream.update(text, is_final=True)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        parser = self.rules.tool_parser()
        if parser is not None and self.tool_stream is not None:
            content, drafts = parser.extract(text if parser.reads_whole_text else content)
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


class AnswerReader:
    """The gRPC API's view of the answers of one call (n choices): each delta's parsed fields
    (None for plain text) and, on a choice's last piece, its tool calls."""

    def __init__(self, rules: OutputRules, prompt_ends_reasoning: bool) -> None:
        self.rules, self.prompt_ends_reasoning = rules, prompt_ends_reasoning
        self._outputs: dict[int, ChoiceOutput] = {}

    def read(self, delta: CompletionDelta) -> tuple[dict[str, Any] | None, list[ToolCall]]:
        if self.rules.is_plain:
            return None, []
        output = self._outputs.get(delta.index)
        if output is None:
            output = self._outputs[delta.index] = ChoiceOutput(
                self.rules, self.prompt_ends_reasoning
            )
        fields = output.update(delta.text, delta.is_finished)
        return fields, output.streamed_calls if delta.is_finished else []

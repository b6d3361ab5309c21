"""Property tests of the reasoning split: thinking and answer come apart the same whole or
streamed in any chunking, alone and in front of tool calls; unfinished thinking is all
reasoning; thinking off (or closed in the prompt) is all content; the parser needs its tokens."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frontend_svc.openai.chat_output import ChatFeatures, ChoiceOutput, OutputRules
from frontend_svc.openai.reasoning import REASONING_PARSERS, ReasoningParser, ReasoningStream
from frontend_svc.openai.tools import ToolsRequest

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
texts = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30).filter(
    lambda s: "<think>" not in s and "</think>" not in s and "<tool_call>" not in s
)
FORMAT = REASONING_PARSERS["qwen3"]


def _streamed(text: str, cuts: list[int], phase: str = "start") -> tuple[str, str]:
    stream = ReasoningStream(FORMAT, phase)
    reasoning = content = ""
    done = 0
    for end in [*sorted(set(cuts)), len(text)]:
        r, c = stream.update(text[done:end], is_final=end == len(text))
        reasoning, content, done = reasoning + r, content + c, end
    return reasoning, content


@SETTINGS
@given(
    thinking=texts,
    answer=texts,
    opened=st.sampled_from(["", "<think>", "\n<think>\n"]),
    data=st.data(),
)
def test_thinking_and_answer_come_apart_in_any_chunking(
    thinking: str, answer: str, opened: str, data: st.DataObject
) -> None:
    text = f"{opened}{thinking}</think>{answer}"
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    expected = (opened.partition("<think>")[2] + thinking, answer)  # a leading <think> dropped
    assert _streamed(text, []) == expected
    assert _streamed(text, cuts) == expected
    assert _streamed(text, list(range(len(text)))) == expected
    unfinished = f"{opened}{thinking}"
    assert _streamed(unfinished, cuts)[1] == ""  # no `</think>`: all of it is reasoning
    assert _streamed(text, cuts, phase="content") == ("", text)


@SETTINGS
@given(thinking=texts, before=texts, city=texts, data=st.data())
def test_reasoning_then_tool_calls_in_any_chunking(
    thinking: str, before: str, city: str, data: st.DataObject
) -> None:
    tools = ToolsRequest(({"type": "function", "function": {"name": "f"}},), "auto")
    features = ChatFeatures("hermes", True, _parser())
    call = json.dumps({"name": "f", "arguments": {"city": city}})
    text = f"<think>{thinking}</think>{before}<tool_call>{call}</tool_call>"
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=12))))
    output = ChoiceOutput(OutputRules(features, tools), False)
    got: dict[str, Any] = {"reasoning": "", "content": "", "arguments": ""}
    done = 0
    for end in [*cuts, len(text)]:
        fields = output.update(text[done:end], is_final=end == len(text))
        done = end
        got["reasoning"] += fields.get("reasoning", "")
        got["content"] += fields.get("content", "")
        got["arguments"] += "".join(
            c["function"]["arguments"] for c in fields.get("tool_calls", [])
        )
    assert (got["reasoning"], got["content"]) == (thinking, before)
    assert json.loads(got["arguments"]) == {"city": city}
    whole = ChoiceOutput(OutputRules(features, tools), False).message(text)
    assert whole["reasoning"] == (thinking or None) and whole["content"] == (before or None)
    assert output.finish_reason("stop") == "tool_calls"


class _Tokenizer:
    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab
        self.all_special_tokens: list[str] = []

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def _parser() -> ReasoningParser:
    return ReasoningParser("qwen3", _Tokenizer({"<think>": 7, "</think>": 8}))


def test_enable_thinking_and_the_prompt_decide_and_tokens_are_required() -> None:
    parser = _parser()
    assert parser.is_thinking(None) and parser.is_thinking({"enable_thinking": True})
    assert not parser.is_thinking({"enable_thinking": False})
    assert ReasoningParser("deepseek_r1", _Tokenizer({"<think>": 1, "</think>": 2})).is_thinking(
        {"enable_thinking": False}
    )  # deepseek_r1 always thinks
    assert parser.tokens.ended_in([1, 7, 3, 8, 4]) and not parser.tokens.ended_in([8, 7, 3])
    assert parser.tokens.ended_in_text("<think>\n\n</think>\n\n")
    assert not parser.tokens.ended_in_text("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="needs the tokens <think> and </think>"):
        ReasoningParser("qwen3", _Tokenizer({"<think>": 1}))

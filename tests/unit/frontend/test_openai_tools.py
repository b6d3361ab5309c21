"""Tool calling and reasoning through the real HTTP app and the openai SDK, over an engine
stand-in that answers a scripted text (a random-weight model cannot be made to write a given
format): what the chat template gets (tools, earlier calls, tool results), the grammar a
required or named choice sends, the calls and thinking read back from the answer — whole and
streamed in small pieces — and refusals naming the field."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client import CollectorRegistry

from frontend_svc.inputs.input_processor import InputProcessor, load_tokenizer
from frontend_svc.openai.app import build_app
from frontend_svc.openai.chat_output import ChatFeatures, tool_markers_are_special
from frontend_svc.openai.generation import ServingContext
from frontend_svc.openai.reasoning import ReasoningParser
from frontend_svc.openai.server import HttpServer
from frontend_svc.requests import CompletionDelta, EngineRequest
from splitserve_contracts.output_types import FinishReason
from splitserve_contracts.sampling_rules import Limits
from tests.unit.frontend.test_openai_app import INFO

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


class ScriptedEngine:
    """Answers every request with `script` in pieces of `piece` characters; keeps the
    requests it got."""

    def __init__(self) -> None:
        self.script = ""
        self.piece = 3
        self.requests: list[EngineRequest] = []

    async def generate(
        self, request: EngineRequest, arrival: float | None = None, coalesce: bool = True
    ) -> AsyncIterator[CompletionDelta]:
        self.requests.append(request)
        pieces = [self.script[i : i + self.piece] for i in range(0, len(self.script), self.piece)]
        for i, text in enumerate(pieces or [""]):
            is_last = i == len(pieces) - 1 or not pieces
            yield CompletionDelta(
                0, [5], text, len(request.prompt_token_ids), i + 1, 0,
                FinishReason.STOP if is_last else FinishReason.UNSPECIFIED,
            )  # fmt: skip


@contextlib.contextmanager
def serving(
    features: ChatFeatures, tokenizer: Any, engine: ScriptedEngine
) -> Iterator[openai.OpenAI]:
    inputs = InputProcessor(tokenizer, INFO.max_model_len, Limits(INFO.vocab_size))
    ctx = ServingContext(engine, inputs, INFO, "m", time.time(), chat=features)  # type: ignore[arg-type]
    app = build_app(ctx, CollectorRegistry())
    loop = asyncio.new_event_loop()
    http = HttpServer(app, "127.0.0.1", 0)
    threading.Thread(target=loop.run_forever, daemon=True).start()
    port = asyncio.run_coroutine_threadsafe(http.start(), loop).result(30)
    try:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    finally:
        asyncio.run_coroutine_threadsafe(http.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)


@pytest.fixture(scope="module")
def tool_tokenizer(tool_model_dir: Path) -> Any:
    return load_tokenizer(str(tool_model_dir))


@pytest.fixture(scope="module")
def engine() -> ScriptedEngine:
    return ScriptedEngine()


@pytest.fixture(scope="module")
def client(tool_tokenizer: Any, engine: ScriptedEngine) -> Iterator[openai.OpenAI]:
    features = ChatFeatures(
        "hermes", True, ReasoningParser("qwen3", tool_tokenizer),
        tool_markers_are_special("hermes", tool_tokenizer),
    )  # fmt: skip
    with serving(features, tool_tokenizer, engine) as sdk:
        yield sdk


def _streamed(chunks: Any) -> dict[str, Any]:
    """A stream's deltas put together: content, reasoning and calls by index."""
    out: dict[str, Any] = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            out["content"] += delta.content or ""
            out["reasoning"] += getattr(delta, "reasoning", None) or ""
            assert getattr(delta, "reasoning", None) == getattr(delta, "reasoning_content", None)
            for call in delta.tool_calls or []:
                entry = out["calls"].setdefault(
                    call.index, {"id": None, "name": "", "arguments": ""}
                )
                if call.id:
                    entry["id"], entry["name"] = call.id, call.function.name
                entry["arguments"] += call.function.arguments or ""
            out["finish"] = choice.finish_reason or out["finish"]
    return out


def _prompt(tokenizer: Any, engine: ScriptedEngine) -> str:
    return str(tokenizer.decode(engine.requests[-1].prompt_token_ids))


def test_auto_reads_hermes_calls_whole_and_streamed(
    client: openai.OpenAI, engine: ScriptedEngine, tool_tokenizer: Any
) -> None:
    engine.script = (
        "<think>the user wants weather</think>Let me look.<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    answer = client.chat.completions.create(model="m", messages=USER, tools=[WEATHER, TIME])
    choice = answer.choices[0]
    assert "get_weather" in _prompt(tool_tokenizer, engine)  # tools reached the template
    assert engine.requests[-1].structured_outputs is None  # auto: no grammar
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    assert choice.message.reasoning == "the user wants weather"  # type: ignore[attr-defined]
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("get_time", {}),
    ]
    assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in calls)
    for piece in (1, 4, 50):
        engine.piece = piece
        stream = client.chat.completions.create(
            model="m", messages=USER, tools=[WEATHER, TIME], stream=True
        )
        got = _streamed(stream)
        assert got["content"] == "Let me look." and got["reasoning"] == "the user wants weather"
        assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == [
            (c.function.name, c.function.arguments) for c in calls
        ]
        assert got["finish"] == "tool_calls"
    engine.piece = 3


def test_parallel_tool_calls_false_keeps_the_first_call(
    client: openai.OpenAI, engine: ScriptedEngine
) -> None:
    engine.script = (
        '<think></think><tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    )
    answer = client.chat.completions.create(
        model="m", messages=USER, tools=[WEATHER, TIME], parallel_tool_calls=False
    )
    assert [c.function.name for c in answer.choices[0].message.tool_calls or []] == ["get_time"]


def test_required_and_named_send_a_grammar_and_read_its_answer(
    client: openai.OpenAI, engine: ScriptedEngine, tool_tokenizer: Any
) -> None:
    engine.script = '<think>x</think>[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    answer = client.chat.completions.create(
        model="m", messages=USER, tools=[WEATHER, TIME], tool_choice="required"
    )
    request = engine.requests[-1]
    schema = json.loads(request.structured_outputs.json)  # type: ignore[union-attr,arg-type]
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert [b["properties"]["name"]["enum"] for b in schema["items"]["anyOf"]] == [
        ["get_weather"], ["get_time"],
    ]  # fmt: skip
    assert request.reasoning_end_token_id == tool_tokenizer.convert_tokens_to_ids("</think>")
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "tool_calls"
    assert [
        (c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []
    ] == [("get_weather", {"city": "Oslo"})]
    engine.script = '{"city": "Lima"}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    stream = client.chat.completions.create(
        model="m",
        messages=USER,
        tools=[WEATHER],
        tool_choice=named,  # type: ignore[arg-type]
        stream=True,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    got = _streamed(stream)
    request = engine.requests[-1]
    assert json.loads(request.structured_outputs.json) == WEATHER["function"]["parameters"]  # type: ignore[union-attr,arg-type,index]
    assert request.reasoning_end_token_id is None  # thinking off: the grammar starts at once
    assert got["calls"][0]["name"] == "get_weather" and got["reasoning"] == ""
    assert json.loads(got["calls"][0]["arguments"]) == {"city": "Lima"}
    assert got["finish"] == "stop"  # a named choice ends with stop, as OpenAI's


def test_earlier_calls_and_tool_results_reach_the_template(
    client: openai.OpenAI, engine: ScriptedEngine, tool_tokenizer: Any
) -> None:
    engine.script = "It is sunny."
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "I should call it",
            "tool_calls": [
                {
                    "id": "call1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
            ],
        },  # fmt: skip
        {"role": "tool", "tool_call_id": "call1", "content": "sunny, 21 C"},
    ]
    answer = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER])  # type: ignore[arg-type]
    prompt = _prompt(tool_tokenizer, engine)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    assert "<think>\nI should call it\n</think>" in prompt
    message = answer.choices[0].message
    assert message.content is None and message.reasoning == "It is sunny."  # type: ignore[attr-defined]
    assert answer.choices[0].finish_reason == "stop"


def test_thinking_off_and_include_reasoning(client: openai.OpenAI, engine: ScriptedEngine) -> None:
    engine.script = "Plain answer."
    answer = client.chat.completions.create(
        model="m", messages=USER, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert answer.choices[0].message.content == "Plain answer."
    assert answer.choices[0].message.reasoning is None  # type: ignore[attr-defined]
    engine.script = "<think>secret</think>shown"
    hidden = client.chat.completions.create(
        model="m", messages=USER, extra_body={"include_reasoning": False}
    )
    assert hidden.choices[0].message.content == "shown"
    assert hidden.choices[0].message.reasoning is None  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}}], "tool_choice": "required"}, "tools"),
    ],
)  # fmt: skip
def test_bad_tool_definitions_are_refused_naming_the_field(
    client: openai.OpenAI, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=USER, extra_body=body)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == param, caught.value.body  # type: ignore[index]


def test_auto_needs_the_server_flags(tool_tokenizer: Any) -> None:
    with (
        serving(ChatFeatures(), tool_tokenizer, ScriptedEngine()) as sdk,
        pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"),
    ):
        sdk.chat.completions.create(model="m", messages=USER, tools=[WEATHER])

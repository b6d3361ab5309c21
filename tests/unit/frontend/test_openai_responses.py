"""/v1/responses through the real HTTP app and the openai SDK over a scripted engine: text
and tool-call turns, whole and streamed (the SDK's own event accumulation must agree), a
follow-up by previous_response_id that carries the call and its output to the template,
retrieve / delete / background and cancel, the bounded store, and errors in OpenAI's shape."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from frontend_svc.inputs.input_processor import load_tokenizer
from frontend_svc.openai import responses_protocol
from frontend_svc.openai.chat_output import ChatFeatures, tool_markers_are_special
from frontend_svc.openai.reasoning import ReasoningParser
from frontend_svc.openai.response_store import ResponseStore
from frontend_svc.openai.sampling_map import CHAT, FIELD_COERCERS
from frontend_svc.requests import CompletionDelta, EngineRequest
from splitserve_contracts.output_types import FinishReason
from tests.unit.frontend.test_openai_tools import ScriptedEngine, serving

TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CALL = '<think>need data</think><tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


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


def _prompt(tokenizer: Any, engine: ScriptedEngine) -> str:
    return str(tokenizer.decode(engine.requests[-1].prompt_token_ids))


def test_a_tool_turn_then_its_follow_up(
    client: openai.OpenAI, engine: ScriptedEngine, tool_tokenizer: Any
) -> None:
    engine.script = CALL
    first = client.responses.create(
        model="m",
        input="Weather in Oslo?",
        instructions="Be brief.",
        tools=[TOOL],  # type: ignore[list-item]
    )
    assert first.status == "completed" and first.id.startswith("resp_")
    assert [item.type for item in first.output] == ["reasoning", "function_call"]
    call = first.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}  # type: ignore[union-attr]
    assert "Be brief." in _prompt(tool_tokenizer, engine)
    assert first.usage is not None and first.usage.output_tokens > 0
    engine.script = "<think></think>It is sunny in Oslo."
    second = client.responses.create(
        model="m",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],  # type: ignore[union-attr]
        tools=[TOOL],  # type: ignore[list-item]
    )
    prompt = _prompt(tool_tokenizer, engine)
    assert "Weather in Oslo?" in prompt and '"city": "Oslo"' in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt
    assert "Be brief." not in prompt  # instructions do not carry over
    assert second.output_text == "It is sunny in Oslo."
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(second.id).output_text == "It is sunny in Oslo."


def test_streamed_events_add_up_to_the_response(
    client: openai.OpenAI, engine: ScriptedEngine
) -> None:
    engine.script = "<think>plan</think>Hello <tool_call>" + CALL.split("<tool_call>")[1]
    for piece in (1, 7):
        engine.piece = piece
        with client.responses.stream(model="m", input="hi", tools=[TOOL]) as stream:  # type: ignore[list-item]
            kinds = [event.type for event in stream]
            final = stream.get_final_response()
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] == "response.completed"
        assert "response.reasoning_text.delta" in kinds and "response.output_text.delta" in kinds
        assert "response.function_call_arguments.delta" in kinds
        assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
        assert final.output_text == "Hello "
        assert json.loads(final.output[2].arguments) == {"city": "Oslo"}  # type: ignore[union-attr]
        stored = client.responses.retrieve(final.id)
        assert [item.id for item in stored.output] == [item.id for item in final.output]
    engine.piece = 3


def test_store_false_incomplete_and_errors(client: openai.OpenAI, engine: ScriptedEngine) -> None:
    engine.script = "<think></think>unsaved"
    unsaved = client.responses.create(model="m", input="x", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unsaved.id)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="m", input="x", previous_response_id="resp_nope")
    assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="m", input="x", max_output_tokens=0)
    assert caught.value.body["param"] == "max_output_tokens"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="m", input="x", tools=[{"type": "web_search"}])  # type: ignore[list-item]
    assert caught.value.body["param"] == "tools[0].type"  # type: ignore[index]
    bad_name = {**TOOL, "name": "bad name"}
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="m", input="x", tools=[bad_name])  # type: ignore[list-item]
    assert caught.value.body["param"] == "tools[0].name"  # type: ignore[index]
    deleted = client.responses.delete  # the SDK returns None for a deletion
    engine.script = "<think></think>kept"
    kept = client.responses.create(model="m", input="x")
    deleted(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


class SlowEngine(ScriptedEngine):
    """Streams max_tokens pieces, one every 10 ms (a background response to cancel)."""

    async def generate(
        self, request: EngineRequest, arrival: float | None = None, coalesce: bool = True
    ) -> AsyncIterator[CompletionDelta]:
        self.requests.append(request)
        num_tokens = request.params.max_tokens or 10_000
        for i in range(num_tokens):
            await asyncio.sleep(0.01)
            reason = FinishReason.LENGTH if i == num_tokens - 1 else FinishReason.UNSPECIFIED
            yield CompletionDelta(0, [5], "x", 3, i + 1, 0, reason)


def test_background_responses_can_be_retrieved_and_cancelled(tool_tokenizer: Any) -> None:
    with serving(ChatFeatures(), tool_tokenizer, SlowEngine()) as sdk:
        started = sdk.responses.create(model="m", input="go", background=True)
        assert started.status == "in_progress"
        time.sleep(0.2)
        assert sdk.responses.retrieve(started.id).status == "in_progress"
        cancelled = sdk.responses.cancel(started.id)
        assert cancelled.status == "cancelled"
        assert sdk.responses.retrieve(started.id).status == "cancelled"
        done = sdk.responses.create(model="m", input="go", max_output_tokens=3, store=True)
        assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]
        with pytest.raises(openai.BadRequestError, match="background"):
            sdk.responses.cancel(done.id)


def test_the_chat_apis_sampling_knobs_pass_through(
    client: openai.OpenAI, engine: ScriptedEngine
) -> None:
    """Every knob the chat API reads by name reaches the engine from /v1/responses too (the
    list follows the contract), but for Responses' own names and the answer's shape."""
    engine.script = "<think></think>ok"
    knobs = {"top_k": 3, "stop_token_ids": [7], "min_tokens": 1, "n": 2, "max_tokens": 1}
    client.responses.create(
        model="m", input="hi", extra_body={**knobs, "spaces_between_special_tokens": False}
    )
    params = engine.requests[-1].params
    assert (params.top_k, params.min_tokens, params.spaces_between_special_tokens) == (3, 1, False)
    assert 7 in params.stop_token_ids and params.n == 1 and params.max_tokens != 1
    elsewhere = {*responses_protocol.NOT_SAMPLED, *dict(responses_protocol.RENAMED), *CHAT.own}
    sampled = set(responses_protocol.PASSED_THROUGH) - set(responses_protocol.CHAT_FIELDS)
    assert sampled == set(FIELD_COERCERS) - elsewhere


def test_the_store_is_bounded_by_size_and_age() -> None:
    now = [0.0]
    store = ResponseStore(max_size=2, ttl_s=10.0, clock=lambda: now[0])
    for i in range(3):
        store.put({"id": f"r{i}"}, [])
    assert store.get("r0") is None and store.get("r2") is not None and len(store) == 2
    now[0] = 11.0
    assert store.get("r2") is None and len(store) == 0 and store.num_bytes == 0
    small = ResponseStore(max_size=100, max_bytes=2_000)
    for i in range(10):
        small.put({"id": f"r{i}"}, [{"role": "user", "content": "x" * 500}])
    assert small.num_bytes <= 2_000 and small.get("r9") is not None and small.get("r0") is None

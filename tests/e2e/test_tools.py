"""Tool calling and reasoning end to end: a real stack serving the tiny model under a
Qwen3-style tokenizer and template (tests/fixtures/tool_model.py) with
`--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3`, called by the
openai SDK and LangChain. The weights are random, so formats are forced by grammars: a
`required` or named choice always comes back as valid calls (at temperature 1.0), an `auto`
answer forced into Hermes' format is read back as calls, and a thinking model's grammar starts
only after it wrote `</think>` (the engine core's reasoning hook)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.e2e.stack import Stack

pytestmark = pytest.mark.slow
FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}},
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "maxLength": 8}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_stack(tool_model_dir: Path) -> Iterator[Stack]:
    stack = Stack(tool_model_dir, frontend_flags=FLAGS).start()
    yield stack
    stack.stop()


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http}/v1", api_key="x", max_retries=0, timeout=300)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _check_calls(calls: list[tuple[str, str]]) -> None:
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _streamed_calls(stream: Any) -> tuple[list[tuple[str, str]], str | None, str]:
    calls: dict[int, list[str]] = {}
    finish, reasoning = None, ""
    for chunk in stream:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning", None) or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return [(n, a) for n, a in calls.values()], finish, reasoning


def test_required_and_named_choices_always_return_valid_calls(tool_stack: Stack) -> None:
    client = _client(tool_stack)
    model = _model(client)
    for seed in range(6):
        answer = client.chat.completions.create(
            model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
            temperature=1.0, seed=seed, max_tokens=400, extra_body=NO_THINKING,
        )  # fmt: skip
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        _check_calls(calls)
        stream = client.chat.completions.create(
            model=model, messages=MESSAGES, tools=TOOLS, stream=True, temperature=1.0, seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=400, extra_body=NO_THINKING,
        )  # fmt: skip
        streamed, finish, _ = _streamed_calls(stream)
        assert finish == "stop" and [n for n, _ in streamed] == ["get_weather"]
        _check_calls(streamed)
    single = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=1.0,
        parallel_tool_calls=False, max_tokens=400, extra_body=NO_THINKING,
    )  # fmt: skip
    assert len(single.choices[0].message.tool_calls or []) == 1


def test_auto_reads_the_parsers_format_whole_and_streamed(tool_stack: Stack) -> None:
    """The model's own Hermes format, forced by a grammar (auto allows a constraint; the
    tags are added tokens, which llguidance's Lark grammars name as <tool_call>)."""
    client = _client(tool_stack)
    forced = (
        'start: <tool_call> "\\n{\\"name\\": \\"get_time\\", \\"arguments\\": '
        '{\\"zone\\": \\"" zone "\\"}}\\n" </tool_call>\nzone: "CET" | "UTC"'
    )
    body = {**NO_THINKING, "structured_outputs": {"grammar": forced}}
    answer = client.chat.completions.create(
        model=_model(client), messages=MESSAGES, tools=TOOLS, temperature=1.0, max_tokens=200,
        extra_body=body,
    )  # fmt: skip
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_time"]
    assert json.loads(calls[0].function.arguments)["zone"] in ("CET", "UTC")
    stream = client.chat.completions.create(
        model=_model(client), messages=MESSAGES, tools=TOOLS, temperature=1.0, max_tokens=200,
        stream=True, extra_body=body,
    )  # fmt: skip
    streamed, finish, _ = _streamed_calls(stream)
    assert finish == "tool_calls" and [n for n, _ in streamed] == ["get_time"]
    assert json.loads(streamed[0][1])["zone"] in ("CET", "UTC")


def test_a_thinking_model_calls_after_its_thinking(tool_stack: Stack, tool_model_dir: Path) -> None:
    """Thinking on: tokens are free until `</think>` (nudged by a logit bias so the random
    model writes it soon), then the grammar holds; reasoning and calls come apart."""
    from transformers import AutoTokenizer

    think_end = AutoTokenizer.from_pretrained(str(tool_model_dir)).convert_tokens_to_ids("</think>")
    client = _client(tool_stack)
    for seed in range(3):
        answer = client.chat.completions.create(
            model=_model(client), messages=MESSAGES, tools=TOOLS, tool_choice="required",
            temperature=1.0, seed=seed, max_tokens=600, logit_bias={str(think_end): 6.0},
        )  # fmt: skip
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.reasoning is not None  # type: ignore[attr-defined]
        assert "</think>" not in choice.message.reasoning  # type: ignore[attr-defined]
        _check_calls(
            [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        )


def test_langchain_bind_tools(tool_stack: Stack) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Forecast(BaseModel):  # bounded: a random model's strings end only at a bound
        city: str = Field(max_length=12)
        days: int = Field(ge=1, le=7)

    @tool(args_schema=Forecast)
    def get_weather(city: str, days: int) -> str:
        """The weather forecast of a city for some days."""
        return "sunny"

    model = _model(_client(tool_stack))
    llm = ChatOpenAI(
        model=model, base_url=f"{tool_stack.http}/v1", api_key="x",  # type: ignore[arg-type]
        temperature=1.0, max_tokens=300, extra_body=NO_THINKING, max_retries=0,
    )  # fmt: skip
    bound = llm.bind_tools([get_weather], tool_choice="any", strict=True)  # closed objects
    message = bound.invoke("Weather in Rome for 3 days?")
    calls = message.tool_calls  # type: ignore[attr-defined]
    assert calls and {c["name"] for c in calls} == {"get_weather"}, message
    for call in calls:
        Forecast.model_validate(call["args"])
    auto = llm.bind_tools([get_weather]).invoke("Say hello.")  # auto: free text, no call
    assert auto.tool_calls == [] and isinstance(auto.content, str)  # type: ignore[attr-defined]


def test_responses_api_tool_turn_follow_up_and_stream(tool_stack: Stack) -> None:
    """The openai SDK's Responses client: a forced tool call, its output sent back by
    previous_response_id, and the same turn streamed (the SDK's event accumulation)."""
    client = _client(tool_stack)
    model = _model(client)
    tools: list[Any] = [{"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMS}]
    first = client.responses.create(
        model=model, input="Weather in Paris?", tools=tools, tool_choice="required",
        temperature=1.0, max_output_tokens=300, extra_body=NO_THINKING,
    )  # fmt: skip
    assert first.status == "completed"
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_PARAMS)
    follow_up = client.responses.create(
        model=model, previous_response_id=first.id, tools=tools, tool_choice="none",
        input=[{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"} for c in calls],
        max_output_tokens=8, extra_body=NO_THINKING,
    )  # fmt: skip
    assert follow_up.status == "incomplete" and follow_up.usage is not None
    assert follow_up.usage.input_tokens > first.usage.input_tokens  # type: ignore[union-attr]
    assert follow_up.output_text  # free text from the random model
    with client.responses.stream(
        model=model, input="Weather in Paris?", tools=tools,
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=1.0, max_output_tokens=300, extra_body=NO_THINKING,
    ) as stream:  # fmt: skip
        kinds = {event.type for event in stream}
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.completed" in kinds
    streamed = [item for item in final.output if item.type == "function_call"]
    assert [c.name for c in streamed] == ["get_weather"]
    jsonschema.validate(json.loads(streamed[0].arguments), WEATHER_PARAMS)
    assert client.responses.retrieve(final.id).output[0].id == final.output[0].id


def _grpc_chat(**fields: Any) -> Any:
    from google.protobuf import struct_pb2

    from splitserve_contracts.common.v1 import types_pb2
    from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2

    kwargs = struct_pb2.Struct()
    kwargs.update({"enable_thinking": False})
    chat = gen_pb2.Chat(
        messages=[gen_pb2.ChatMessage(role="user", content="Weather in Paris?")],
        chat_template_kwargs=kwargs,
    )
    tools = [
        gen_pb2.Tool(
            name=t["function"]["name"], parameters_json=json.dumps(t["function"]["parameters"])
        )
        for t in TOOLS
    ]
    params = types_pb2.SamplingParams(temperature=1.0, max_tokens=300, seed=3)
    return gen_pb2.GenerateRequest(chat=chat, tools=tools, sampling_params=params, **fields)


def test_grpc_tools_and_parsed_calls(tool_stack: Stack) -> None:
    """The public gRPC API: tools and tool_choice on a chat request, the calls read back on
    the last piece, and a bad definition refused naming the field."""
    import grpc

    from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
    from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc

    with grpc.insecure_channel(tool_stack.frontend) as channel:
        stub = gen_grpc.GenerationServiceStub(channel)
        required = gen_pb2.ToolChoice(mode=gen_pb2.TOOL_CHOICE_MODE_REQUIRED)
        pieces = list(stub.Generate(_grpc_chat(tool_choice=required), timeout=120))
        assert pieces[-1].finish_reason and pieces[-1].tool_calls
        assert all(not p.tool_calls for p in pieces[:-1]) and "".join(p.text for p in pieces) == ""
        _check_calls([(c.name, c.arguments) for c in pieces[-1].tool_calls])
        assert all(c.id.startswith("chatcmpl-tool-") for c in pieces[-1].tool_calls)
        named = gen_pb2.ToolChoice(function_name="get_time")
        last = list(stub.Generate(_grpc_chat(tool_choice=named), timeout=120))[-1]
        assert [c.name for c in last.tool_calls] == ["get_time"]
        _check_calls([(c.name, c.arguments) for c in last.tool_calls])
        bad = _grpc_chat(tool_choice=required)
        bad.tools[0].parameters_json = '{"type": "array"}'
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(bad, timeout=60))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "tools[0].parameters_json" in str(caught.value.details())

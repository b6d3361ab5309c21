"""Structured outputs under hostile grammars and mismatched vocabularies, end to end over real
processes (issue 37 items 1 and 6):

- a legal regex past llguidance's matcher limits, `((a|aa){50}){50}`, sent again and again in
  every request form, is a 400 naming the limit every time: never the 503 "retry it" that
  blamed the rank, never a 200 whose output breaks the constraint (the empty "stop" a copy of
  the exhausted cached grammar gave);
- max_tokens reached mid-grammar ends with finish_reason "length";
- on Qwen2-style checkpoints whose tokenizer (transformers' Qwen2Tokenizer, 3,001 ids) is wider
  than the model (3,000) or narrower (3,072), response_format, structured_outputs and
  tool_choice "required" are served, as plain generation is (tests/fixtures/qwen2_vocab.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from tests.e2e.stack import Stack
from tests.fixtures.qwen2_vocab import NUM_BPE_TOKENS, make_qwen2_checkpoint
from tests.reliability.http_probes import (
    assert_http_serving_and_idle,
    assert_openai_error,
    post_json,
)

pytestmark = pytest.mark.slow
HUGE_REGEX = "((a|aa){50}){50}"
LEXER_LIMIT = (
    "refused by the engine: structured_outputs.regex: the grammar could not be followed: "
    "lexer error: too many expressions constructed"
)
CHAT = [{"role": "user", "content": "Say the letter a many times."}]
RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]


def _sse_events(text: str) -> list[Any]:
    return [
        json.loads(line[len("data: ") :])
        for line in text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def _assert_refused_by_name(status: int, reply: Any) -> None:
    """A 400 naming the limit; a stream that had begun may end with that error instead, but
    no chunk of it finishes."""
    if status == 400:
        error = assert_openai_error(reply, 400)
        assert error["message"] == LEXER_LIMIT and error["type"] == "invalid_request_error"
        return
    assert status == 200 and isinstance(reply, str), reply
    events = _sse_events(reply)
    assert events and events[-1].get("error", {}).get("message") == LEXER_LIMIT, events[-3:]
    for event in events[:-1]:
        assert not [c for c in event.get("choices", []) if c.get("finish_reason")], event


def test_a_regex_past_the_matchers_limits_is_a_400_naming_it_every_time(
    shared_stack: Stack,
) -> None:
    forms: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", {"prompt": "a", "structured_outputs": {"regex": HUGE_REGEX}}),
        ("/v1/completions", {"prompt": "a", "guided_regex": HUGE_REGEX, "stream": True}),
        ("/v1/chat/completions", {"messages": CHAT, "structured_outputs": {"regex": HUGE_REGEX}}),
        ("/v1/chat/completions", {"messages": CHAT, "guided_regex": HUGE_REGEX, "stream": True}),
    ]
    for _ in range(3):  # each after the grammar's cached copy failed
        for path, body in forms:
            status, reply = post_json(shared_stack.http, path, {**body, "max_tokens": 64})
            _assert_refused_by_name(status, reply)
    assert_http_serving_and_idle(shared_stack)


def test_max_tokens_reached_mid_grammar_is_length(shared_stack: Stack) -> None:
    body = {"prompt": "digits", "max_tokens": 5, "structured_outputs": {"regex": "[0-9]{300}"}}
    status, reply = post_json(shared_stack.http, "/v1/completions", body)
    assert status == 200 and reply["choices"][0]["finish_reason"] == "length", reply
    assert re.fullmatch("[0-9]+", reply["choices"][0]["text"]), reply
    schema = {"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD}}
    body = {"messages": CHAT, "max_tokens": 5, "response_format": schema}  # needs 8 at least
    status, reply = post_json(shared_stack.http, "/v1/chat/completions", body)
    assert status == 200 and reply["choices"][0]["finish_reason"] == "length", reply
    assert reply["usage"]["completion_tokens"] == 5
    assert reply["choices"][0]["message"]["content"].startswith("{"), reply
    assert_http_serving_and_idle(shared_stack)


@pytest.fixture(scope="module", params=[NUM_BPE_TOKENS, 3072], ids=["narrower", "padded"])
def qwen2_stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """A Qwen2 checkpoint of config.vocab_size 3,000 (its tokenizer's `<|endoftext|>` is id
    3,000, past the model) or 3,072 (padded past the tokenizer)."""
    vocab_size = request.param
    folder = make_qwen2_checkpoint(tmp_path_factory.mktemp("qwen2-vocab") / "qwen2", vocab_size)
    stack = Stack(folder).start()
    yield stack
    stack.stop()


def test_structured_outputs_are_served_whichever_vocabulary_is_larger(qwen2_stack: Stack) -> None:
    """Seeded sampling of seeded weights: the same outputs on every run."""
    http = qwen2_stack.http
    status, plain = post_json(http, "/v1/completions", {"prompt": "red city", "max_tokens": 8})
    assert status == 200 and plain["choices"][0]["finish_reason"], plain
    regex = r"[a-z]{2,5}-[0-9]{3}"
    body = {
        "prompt": "red city",
        "max_tokens": 32,
        "seed": 0,
        "structured_outputs": {"regex": regex},
    }
    status, reply = post_json(http, "/v1/completions", body)
    assert status == 200 and reply["choices"][0]["finish_reason"] == "stop", reply
    assert re.fullmatch(regex, reply["choices"][0]["text"]), reply
    schema = {"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD}}
    body = {"messages": CHAT, "max_tokens": 200, "seed": 0, "response_format": schema}
    status, reply = post_json(http, "/v1/chat/completions", body)
    assert status == 200 and reply["choices"][0]["finish_reason"] == "stop", reply
    jsonschema.validate(json.loads(reply["choices"][0]["message"]["content"]), RECORD)
    body = {"messages": CHAT, "max_tokens": 200, "seed": 0, "tools": TOOLS}
    body["tool_choice"] = "required"
    status, reply = post_json(http, "/v1/chat/completions", body)
    assert status == 200, reply
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    for call in choice["message"]["tool_calls"]:
        assert call["function"]["name"] == "lookup"
        jsonschema.validate(
            json.loads(call["function"]["arguments"]), TOOLS[0]["function"]["parameters"]
        )
    assert_http_serving_and_idle(qwen2_stack)

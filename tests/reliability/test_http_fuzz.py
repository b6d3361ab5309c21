"""Property-based fuzzing of the OpenAI HTTP API over real processes on loopback (the HTTP side of
test_fuzz.py): JSON bodies of plausible and implausible fields for the generation routes and the
tokenizer routes, and random or spliced bytes on every POST route. Every reply is a 200 or a
refusal in OpenAI's error shape (never a 500, never a Python exception's text), no service dies,
and the stack still serves with nothing leaked. Seeded (derandomize) so CI is reproducible."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.stack import Stack
from tests.reliability.http_cases import CHAT, COMPLETIONS, DETOKENIZE, TOKENIZE
from tests.reliability.http_probes import (
    assert_http_serving_and_idle,
    assert_openai_error,
    http_call,
    post_json,
)
from tests.reliability.probes import wait_idle

pytestmark = pytest.mark.slow
FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
REFUSALS = (400, 404)
TEXT = st.text(min_size=1, max_size=20)
BIG_INTS = st.sampled_from([2**31, 2**32, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30])
NUMBERS = (
    st.integers(-(2**70), 2**70)
    | BIG_INTS
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([1e39, -1e39, 1e-130, 3.4e38])
)
JSON = st.recursive(
    st.none() | st.booleans() | NUMBERS | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
ROLES = st.sampled_from(["user", "system", "assistant"])
MESSAGES = st.lists(st.fixed_dictionaries({"role": ROLES, "content": TEXT}), min_size=1, max_size=3)
IDS = st.lists(st.integers(-5, 2100) | BIG_INTS, max_size=6)
PLAUSIBLE = {
    "n": st.integers(-1, 3) | BIG_INTS, "temperature": st.floats(-1, 3) | NUMBERS,
    "top_p": st.floats(-0.5, 1.5), "top_k": st.integers(-2, 60) | BIG_INTS,
    "seed": st.integers(-(2**64), 2**64), "stop": TEXT | st.lists(TEXT),
    "logprobs": st.integers(-1, 25) | st.booleans() | BIG_INTS,
    "top_logprobs": st.integers(-1, 25) | BIG_INTS, "echo": st.booleans(),
    "stream": st.booleans(), "min_tokens": st.integers(-1, 8) | BIG_INTS,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "logit_bias": st.dictionaries(st.integers(-5, 5000).map(str), st.floats(-200, 200)),
    "stop_token_ids": IDS, "allowed_token_ids": IDS, "prompt_logprobs": st.integers(-1, 3),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["tokenize", "x"]), JSON),
    "continue_final_message": st.booleans(), "add_generation_prompt": st.booleans(),
    "prompt": TEXT | IDS | st.lists(TEXT, max_size=3) | st.lists(IDS, max_size=3),
    "messages": MESSAGES, "max_tokens": st.integers(-2, 4) | BIG_INTS,
    "max_completion_tokens": st.integers(-2, 4), "best_of": st.integers(0, 3),
    "response_format": JSON, "priority": st.integers(-3, 3) | BIG_INTS,
    "request_id": st.text(max_size=300), "cache_salt": st.text(max_size=8),
    "model": st.sampled_from(["tiny-llama-v1", "other"]),
}  # fmt: skip
BODIES = st.builds(
    lambda base, extra: {**base, **extra},
    st.fixed_dictionaries(
        {"prompt": TEXT, "messages": MESSAGES, "max_tokens": st.integers(1, 4),
         "ignore_eos": st.just(True)}
    ),
    st.lists(st.sampled_from(sorted(PLAUSIBLE)), max_size=3, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: PLAUSIBLE[k] | JSON for k in keys})
    ),
)  # fmt: skip
"""A body that would be served, with up to three fields set to plausible or arbitrary values."""
UNSENT_NAMEABLE = {"max_tokens", "prompt", "messages"}
"""Fields a refusal may name though the body leaves them out: one the endpoint fills by default,
the required ones."""


def _root(param: str) -> str:
    return param.split(".")[0].split("[")[0]


def _check_reply(status: int, reply: Any, body: dict[str, Any]) -> None:
    if status == 200:
        return
    assert status in REFUSALS, (status, reply)
    error = assert_openai_error(reply, status)
    if error["param"] is not None:
        named = _root(error["param"])
        aliases = {"top_logprobs": "logprobs", "max_completion_tokens": "max_tokens"}
        assert named in body or named in UNSENT_NAMEABLE or aliases.get(named) in body, (
            error,
            body,
        )


@settings(FUZZ, max_examples=100)
@given(body=BODIES, is_chat=st.booleans())
def test_fuzzed_generation_bodies_get_a_reply_or_a_named_refusal(
    shared_stack: Stack, body: dict[str, Any], is_chat: bool
) -> None:
    status, reply = post_json(shared_stack.http, CHAT if is_chat else COMPLETIONS, body)
    _check_reply(status, reply, body)
    if status == 200 and not body.get("stream"):
        assert reply["choices"] and all(c["finish_reason"] for c in reply["choices"])
    wait_idle(shared_stack)


TOKENIZER_BODIES = st.one_of(
    st.fixed_dictionaries({"tokens": IDS | JSON}, optional={"model": JSON}),
    st.fixed_dictionaries(
        {"prompt": TEXT | JSON},
        optional={"add_special_tokens": JSON, "return_token_strs": st.booleans() | JSON},
    ),
    st.fixed_dictionaries(
        {"messages": MESSAGES | JSON},
        optional={"chat_template_kwargs": JSON, "add_generation_prompt": JSON},
    ),
)


@settings(FUZZ, max_examples=40)
@given(body=TOKENIZER_BODIES)
def test_fuzzed_tokenizer_bodies_get_a_reply_or_a_named_refusal(
    shared_stack: Stack, body: dict[str, Any]
) -> None:
    path = DETOKENIZE if "tokens" in body else TOKENIZE
    status, reply = post_json(shared_stack.http, path, body)
    _check_reply(status, reply, body)
    if status == 200:
        assert ("prompt" in reply) if path == DETOKENIZE else reply["count"] == len(reply["tokens"])


def _spliced(body: dict[str, Any], cut: int, junk: bytes) -> bytes:
    data = json.dumps(body).encode()
    cut %= len(data) + 1
    return data[:cut] + junk + data[cut:]


PAYLOADS = st.binary(max_size=64) | st.builds(
    _spliced, BODIES, st.integers(0, 400), st.binary(min_size=1, max_size=8)
)
"""Random bytes, or a valid body with random bytes spliced in (mostly not JSON any more)."""


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, TOKENIZE, DETOKENIZE])
def test_random_bytes_get_a_proper_refusal_on_every_route(shared_stack: Stack, path: str) -> None:
    @settings(FUZZ, max_examples=25)
    @given(payload=PAYLOADS)
    def replies_are_proper(payload: bytes) -> None:
        status, reply, _ = http_call(shared_stack.http, "POST", path, payload)
        if status != 200:
            assert status in REFUSALS, (status, reply)
            assert_openai_error(reply, status)
        for child in shared_stack.children:
            assert child.process.poll() is None, f"{child.name} died"

    replies_are_proper()
    assert_http_serving_and_idle(shared_stack)

"""OpenAI request bodies -> the frontend's requests: the table-driven SamplingParams mapping,
vLLM's aliases and defaults, refusals naming their field."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from frontend_svc.config import parse_config
from frontend_svc.errors import InvalidRequest
from frontend_svc.openai import sampling_map
from frontend_svc.openai.fields import parse_json_object
from frontend_svc.openai.protocol import (
    UNSUPPORTED,
    ChatRequest,
    CompletionRequest,
    RequestLimits,
    parse_chat,
    parse_completion,
)
from splitserve_contracts.sampling_rules import Limits
from splitserve_contracts.sampling_types import SamplingParams

EXAMPLES: dict[type, Any] = {int: 3, float: 0.5, bool: True}
LIMITS = RequestLimits(Limits(vocab_size=2048), max_fan_out=100)


def completion(body: dict[str, Any]) -> CompletionRequest:
    return parse_completion(body, LIMITS)


def chat(body: dict[str, Any]) -> ChatRequest:
    return parse_chat(body, LIMITS)


def _example(name: str, value: Any) -> tuple[Any, Any]:
    """(JSON value, expected SamplingParams value) for a field whose default is `value`."""
    if isinstance(value, bool):
        return (not value), (not value)
    if isinstance(value, int) or value is None:
        return 3, 3
    if isinstance(value, float):
        return 0.5, 0.5
    if isinstance(value, tuple):
        is_text = name == "stop"
        return (["a", "b"], ("a", "b")) if is_text else ([4, 5], (4, 5))
    if isinstance(value, dict):
        return {"7": 1.5}, {7: 1.5}
    raise AssertionError(f"no example for {name}")


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(SamplingParams)])
def test_every_contract_field_is_read_by_its_own_name(field: str) -> None:
    """The mapping is the contract's field list: a new field needs no HTTP change."""
    default = getattr(SamplingParams(), field)
    sent, expected = _example(field, default)
    params = completion({"prompt": "x", field: sent}).params
    assert getattr(params, field) == expected
    if field != "logprobs":  # chat's logprobs is OpenAI's bool
        assert getattr(chat({"messages": [], field: sent} | MSG).params, field) == expected


MSG = {"messages": [{"role": "user", "content": "hi"}]}


def test_vllm_defaults_and_aliases() -> None:
    assert completion({"prompt": "x"}).params.max_tokens == 16  # OpenAI's default
    assert chat(MSG).params.max_tokens is None  # the rest of the context
    both = chat(MSG | {"max_tokens": 5, "max_completion_tokens": 7})
    assert both.params.max_tokens == 7
    assert chat(MSG | {"logprobs": True, "top_logprobs": 3}).params.logprobs == 3
    assert chat(MSG | {"logprobs": True}).params.logprobs == 0
    assert chat(MSG | {"logprobs": False}).params.logprobs is None
    echo = completion({"prompt": "x", "echo": True, "logprobs": 2})
    assert echo.params.prompt_logprobs == 2


def test_numbers_are_read_as_the_contract_carries_them() -> None:
    """A 32-bit float: the frontend checks what the engine gets (1.8e-130 arrives as 0.0, which
    a top_p check must see, not the double that passes it)."""
    with pytest.raises(InvalidRequest, match="top_p must be in"):
        completion({"prompt": "x", "top_p": 1.8e-130})
    assert completion({"prompt": "x", "temperature": 0.1}).params.temperature == pytest.approx(
        0.1, rel=1e-7
    )


def test_null_and_unknown_fields_are_ignored() -> None:
    req = completion({"prompt": "x", "stop": None, "frobnicate": {"a": 1}, "user": "u"})
    assert req.params == dataclasses.replace(SamplingParams(), max_tokens=16)


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("hi", [("hi", None)]),
        (["a", "b"], [("a", None), ("b", None)]),
        ([1, 2, 3], [(None, (1, 2, 3))]),
        ([[1], [2, 3]], [(None, (1,)), (None, (2, 3))]),
    ],
)
def test_the_four_prompt_forms(prompt: Any, expected: list[Any]) -> None:
    prompts = completion({"prompt": prompt}).prompts
    assert [(p.text, p.token_ids) for p in prompts] == expected


def test_chat_content_parts_and_options() -> None:
    body = {
        "messages": [
            {"role": "system", "content": None},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ],
        "add_generation_prompt": False,
        "continue_final_message": True,
        "chat_template_kwargs": {"enable_thinking": False},
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }  # fmt: skip
    req = chat(body)
    assert [(t.role, t.content) for t in req.prompt.chat or ()] == [
        ("system", ""),
        ("user", "a\nb"),
    ]
    assert not req.prompt.add_generation_prompt and req.prompt.continue_final_message
    assert req.prompt.chat_template_kwargs == {"enable_thinking": False}
    assert req.stream is not None and req.stream.include_usage
    assert req.stream.continuous_usage_stats


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens", "integer"),
        ({"prompt": "x", "temperature": True}, "temperature", "number"),
        ({"prompt": "x", "stop": [1]}, "stop", "string"),
        ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias", "token ids"),
        # the contract carries 32-bit floats: too large for one is refused here
        ({"prompt": "x", "temperature": 1e39}, "temperature", "too large"),
        ({"prompt": []}, "prompt", "empty"),
        ({"prompt": [1, "a"]}, "prompt", "must be"),
        ({}, "prompt", "required"),
        ({"prompt": "x", "stream_options": {}}, "stream_options", "stream: true"),
        ({"prompt": "x", "suffix": "s"}, "suffix", "not supported"),
        ({"prompt": "x", "best_of": 3}, "best_of", "not supported"),
        (MSG | {"top_logprobs": 2}, "top_logprobs", "logprobs: true"),
        (MSG | {"echo": True}, "echo", "not supported"),
        ({"messages": [{"content": "x"}]}, "messages[0]", "role"),
        ({"messages": [{"role": 5, "content": "x"}]}, "messages[0].role", "string"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0].image_url",
            "needs a `url`",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "messages[0].content[0]",
            "not supported",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "x"}]}]},
            "messages[0].content",
            "unknown",
        ),
        # every number is bounded while the body is parsed, before anything is built per n
        ({"prompt": "x", "n": 2**63 - 1}, "n", "n must be in [1, 64]"),
        (MSG | {"n": 2**63 - 1, "temperature": 1}, "n", "n must be in [1, 64]"),
        (MSG | {"logprobs": True, "top_logprobs": 2**63 - 1}, "top_logprobs", "logprobs must"),
        (MSG | {"max_completion_tokens": 0}, "max_completion_tokens", "max_tokens must be >= 1"),
        ({"prompt": "x", "max_tokens": 2**64}, "max_tokens", "max_tokens must be <="),
        ({"prompt": "x", "seed": 2**63}, "seed", "seed must be <="),
        ({"prompt": "x", "priority": 2**31}, "priority", "must be in [-2147483648"),
        ({"prompt": "x", "temperature": 10**400}, "temperature", "too large"),
        ({"prompt": "x", "logit_bias": {"1" * 5000: 1}}, "logit_bias", "(5000 characters)"),
        (
            {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}},
            "stream_options.include_usage",
            "true or false",
        ),
        ({"prompt": ["x"] * 101}, "prompt", "at most 100 per call (--max-fan-out)"),
        ({"prompt": [[1]] * 51, "n": 2, "temperature": 1}, "prompt", "102 engine requests"),
    ],
)
def test_refusals_name_the_field(body: dict[str, Any], param: str, words: str) -> None:
    parse = chat if "messages" in body else completion
    with pytest.raises(InvalidRequest) as err:
        parse(body)
    assert err.value.param == param and words in str(err.value)


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_every_unsupported_field_is_refused_and_its_neutral_value_is_not(name: str) -> None:
    with pytest.raises(InvalidRequest, match=name):
        completion({"prompt": "x", name: {"type": "json_object", "x": 2}})
    completion({"prompt": "x", name: None})


@pytest.mark.parametrize("raw", [b"[1]", b"{", b'{"a": NaN}', b'{"a": Infinity}', b"\xff"])
def test_bodies_that_are_not_json_objects_are_400s(raw: bytes) -> None:
    with pytest.raises(InvalidRequest):
        parse_json_object(raw)


HUGE = b"9" * 100_000


@pytest.mark.parametrize(
    "raw, param, words",
    [
        (b'{"prompt": "x", "max_tokens": ' + HUGE + b"}", "max_tokens", "more than 4300 digits"),
        (b'{"prompt": [1, [' + HUGE + b"]]}", "prompt", "more than 4300 digits"),
        (b'{"prompt": "a\\ud800b"}', "prompt", "lone UTF-16 surrogate"),
        (b'{"prompt": "x", "stop": ["\\udfff"]}', "stop", "lone UTF-16 surrogate"),
        (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages", "surrogate"),
        (b'{"\\ud800": 1}', "\\ud800", "surrogate"),
    ],
)
def test_text_and_numbers_no_field_can_take_are_refused_by_name(
    raw: bytes, param: str, words: str
) -> None:
    """An integer Python will not convert, text no UTF-8 can carry: a 400 naming the field, not
    a 500 from deep inside (the tokenizer, the reply's encoder)."""
    with pytest.raises(InvalidRequest) as err:
        parse_json_object(raw)
    assert err.value.param == param and words in str(err.value)
    assert str(err.value).encode()  # the message itself is valid text


def test_surrogate_pairs_are_text() -> None:
    """A JSON encoder that escapes non-ASCII sends an emoji as a surrogate pair: valid."""
    assert parse_json_object(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\U0001f600"}


def test_a_field_the_coercers_cannot_map_fails_at_import_not_at_request_time() -> None:
    """The table is built when the module loads: a contract field of a new type shows up as a
    KeyError there, never as a 500 later."""
    assert set(sampling_map.FIELD_COERCERS) == {f.name for f in dataclasses.fields(SamplingParams)}


def test_the_fan_out_cap_is_a_flag_at_least_max_n() -> None:
    assert parse_config(["--model", "m"], {}).max_fan_out == 1024
    assert parse_config(["--model", "m", "--max-fan-out", "4096"], {}).max_fan_out == 4096
    assert parse_config(["--model", "m"], {"SPLITSERVE_MAX_FAN_OUT": "64"}).max_fan_out == 64
    with pytest.raises(SystemExit):  # n alone fans out up to --max-n (64)
        parse_config(["--model", "m", "--max-fan-out", "8"], {})

"""The bad-input table of the public API (GenerationService), against the tiny model: what a
hostile or careless client sends, and the status it must get. Each row is one case of
test_public_bad_input.py; ACCEPTED holds the edges that must be served, not refused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2

VOCAB_SIZE = 2048
MAX_MODEL_LEN = 2048
"""The tiny model's facts; the module checks them against GetModelInfo before any case."""
INVALID = grpc.StatusCode.INVALID_ARGUMENT
TOO_BIG = grpc.StatusCode.RESOURCE_EXHAUSTED
NOT_FOUND = grpc.StatusCode.NOT_FOUND
NAN, INF = float("nan"), float("inf")
INT32_MIN, INT32_MAX, UINT32_MAX = -(2**31), 2**31 - 1, 2**32 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FIVE_MIB_TEXT = "word " * (1024 * 1024)


@dataclass(frozen=True)
class Case:
    """One call and what it must get: `code` with `fragment` in its message and, when `field`
    is set, a google.rpc.BadRequest violation naming that field."""

    id: str
    rpc: str
    request: Any
    """A request message, or raw bytes sent as the request."""
    code: grpc.StatusCode
    fragment: str
    field: str = ""


def gen(prompt: str = "hi", **params: Any) -> gen_pb2.GenerateRequest:
    return gen_pb2.GenerateRequest(
        prompt=prompt, sampling_params=types_pb2.SamplingParams(**params)
    )


def ids(token_ids: list[int], **params: Any) -> gen_pb2.GenerateRequest:
    return gen_pb2.GenerateRequest(
        prompt_token_ids=gen_pb2.TokenIds(ids=token_ids),
        sampling_params=types_pb2.SamplingParams(**params),
    )


def chat(*turns: tuple[str, str], **params: Any) -> gen_pb2.GenerateRequest:
    messages = [gen_pb2.ChatMessage(role=r, content=c) for r, c in turns]
    return gen_pb2.GenerateRequest(
        chat=gen_pb2.Chat(messages=messages), sampling_params=types_pb2.SamplingParams(**params)
    )


def generate_case(
    id: str, request: Any, fragment: str, field: str = "", code: Any = INVALID
) -> Case:
    return Case(id, "Generate", request, code, fragment, field)


def sampling(id: str, fragment: str, **params: Any) -> Case:
    """A Generate whose sampling_params break a rule: the violation names the field."""
    field = "sampling_params." + next(iter(params))
    return generate_case(id, gen(**params), fragment, field)


def with_fields(request: gen_pb2.GenerateRequest, **fields: Any) -> gen_pb2.GenerateRequest:
    for name, value in fields.items():
        setattr(request, name, value)
    return request


def _wire(field_number: int, wire_type: int, payload: bytes) -> bytes:
    return bytes([(field_number << 3) | wire_type]) + payload


TRUNCATED = _wire(2, 2, b"\x05ab")  # prompt: 5 bytes announced, 2 sent
WRONG_WIRE_TYPE = _wire(5, 0, b"\x01")  # sampling_params as a varint
BAD_UTF8 = _wire(2, 2, b"\x02\xff\xfe")  # prompt: a proto3 string that is not UTF-8
BAD_NESTED = _wire(5, 2, b"\x03" + _wire(2, 5, b"\x00"))  # a float cut short inside
GARBAGE = b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff"

PROMPT_CASES = [
    generate_case("no-prompt", gen_pb2.GenerateRequest(), "no prompt given", "prompt"),
    generate_case("empty-text", gen(""), "prompt is empty", "prompt"),
    generate_case("empty-ids", ids([]), "prompt_token_ids is empty", "prompt_token_ids"),
    generate_case("id-at-vocab", ids([VOCAB_SIZE]), "outside the vocabulary", "prompt_token_ids"),
    generate_case("id-uint32-max", ids([UINT32_MAX]), "outside the vocabulary", "prompt_token_ids"),
    generate_case(
        "id-late-in-prompt", ids([5, 6, 4000]), "prompt_token_ids[2]", "prompt_token_ids"
    ),
    generate_case(
        "ids-fill-max-model-len", ids([5] * MAX_MODEL_LEN), "max_model_len", "prompt_token_ids"
    ),
    generate_case("ids-100k", ids([5] * 100_000), "max_model_len", "prompt_token_ids"),
    generate_case(
        "text-tokens-over-max-model-len", gen("river " * 3000), "max_model_len is", "prompt"
    ),
    generate_case("text-100k-chars", gen("x" * 100_000), "more than any prompt", "prompt"),
    generate_case("text-5mib", gen(FIVE_MIB_TEXT), "larger than max", code=TOO_BIG),
    generate_case("chat-empty", chat(), "chat has no messages", "chat"),
    generate_case("chat-1mb", chat(("user", "y" * 1_000_000)), "more than any prompt", "chat"),
    generate_case(
        "chat-over-max-model-len", chat(("user", "stone " * 3000)), "max_model_len", "chat"
    ),
    generate_case(
        "model-unknown",
        gen_pb2.GenerateRequest(prompt="hi", model="nope"),
        "does not exist",
        code=NOT_FOUND,
    ),
    generate_case(
        "model-wrong-case",
        gen_pb2.GenerateRequest(prompt="hi", model="TINY-LLAMA-V1"),
        "does not exist",
        code=NOT_FOUND,
    ),
    generate_case(
        "model-name-1mb",
        gen_pb2.GenerateRequest(prompt="hi", model="m" * 1_000_000),
        "does not exist",
        code=NOT_FOUND,
    ),
    generate_case(
        "request-id-257",
        gen_pb2.GenerateRequest(prompt="hi", request_id="r" * 257),
        "at most 256",
        "request_id",
    ),
    generate_case(
        "request-id-1mb",
        gen_pb2.GenerateRequest(prompt="hi", request_id="r" * 10**6),
        "at most 256",
        "request_id",
    ),
    generate_case(
        "cache-salt-257",
        gen_pb2.GenerateRequest(prompt="hi", cache_salt="s" * 257),
        "at most 256",
        "cache_salt",
    ),
]

SAMPLING_CASES = [
    sampling("n-65", "n must be in [1, 64]", n=65, temperature=1.0),
    sampling("n-uint32-max", "n must be in [1, 64]", n=UINT32_MAX, temperature=1.0),
    sampling("n-greedy", "identical", n=2, temperature=0.0),
    sampling("temperature-negative", "temperature must be finite", temperature=-1.0),
    sampling("temperature-nan", "temperature must be finite", temperature=NAN),
    sampling("temperature-inf", "temperature must be finite", temperature=INF),
    sampling("temperature-minus-inf", "temperature must be finite", temperature=-INF),
    sampling("top-p-zero", "top_p must be in (0, 1]", top_p=0.0),
    sampling("top-p-above-one", "top_p must be in (0, 1]", top_p=1.5),
    sampling("top-p-nan", "top_p must be in (0, 1]", top_p=NAN),
    sampling("top-p-minus-inf", "top_p must be in (0, 1]", top_p=-INF),
    sampling("top-k-minus-two", "top_k must be -1", top_k=-2),
    sampling("top-k-int32-min", "top_k must be -1", top_k=INT32_MIN),
    sampling("min-p-above-one", "min_p must be in [0, 1]", min_p=1.5),
    sampling("min-p-negative", "min_p must be in [0, 1]", min_p=-0.1),
    sampling("min-p-nan", "min_p must be in [0, 1]", min_p=NAN),
    sampling("presence-penalty-2.5", "presence_penalty must be in [-2, 2]", presence_penalty=2.5),
    sampling("presence-penalty-nan", "presence_penalty must be in", presence_penalty=NAN),
    sampling("frequency-penalty-minus-3", "frequency_penalty must be in", frequency_penalty=-3.0),
    sampling("frequency-penalty-inf", "frequency_penalty must be in", frequency_penalty=INF),
    sampling("repetition-penalty-zero", "repetition_penalty must be in", repetition_penalty=0.0),
    sampling("repetition-penalty-negative", "repetition_penalty must", repetition_penalty=-1.0),
    sampling("repetition-penalty-inf", "repetition_penalty must be in", repetition_penalty=INF),
    sampling("repetition-penalty-1e30", "repetition_penalty must be in", repetition_penalty=1e30),
    sampling("repetition-penalty-nan", "repetition_penalty must be in", repetition_penalty=NAN),
    sampling("max-tokens-zero", "max_tokens must be >= 1", max_tokens=0),
    sampling("max-tokens-uint32-max", "exceeds max_model_len", max_tokens=UINT32_MAX),
    sampling("max-tokens-max-model-len", "exceeds max_model_len", max_tokens=MAX_MODEL_LEN),
    sampling("min-tokens-uint32-max", "lower min_tokens", min_tokens=UINT32_MAX),
    sampling("min-tokens-above-max-tokens", "must not exceed", min_tokens=9, max_tokens=3),
    sampling("logprobs-21", "logprobs must be in [0, 20]", logprobs=21),
    sampling("logprobs-negative", "logprobs must be in [0, 20]", logprobs=-1),
    sampling("logprobs-int32-max", "logprobs must be in [0, 20]", logprobs=INT32_MAX),
    sampling("prompt-logprobs-21", "prompt_logprobs must be in", prompt_logprobs=21),
    sampling("prompt-logprobs-negative", "prompt_logprobs must be in", prompt_logprobs=-5),
    sampling("stop-33-strings", "at most 32", stop=["a"] * 33),
    sampling("stop-empty-string", "stop[0] must have", stop=[""]),
    sampling("stop-257-chars", "stop[0] must have", stop=["s" * 257]),
    sampling("stop-token-id-at-vocab", "outside the vocabulary", stop_token_ids=[VOCAB_SIZE]),
    sampling("stop-token-ids-5000", "at most 4096", stop_token_ids=[5] * 5000),
    sampling("allowed-id-at-vocab", "outside the vocabulary", allowed_token_ids=[VOCAB_SIZE]),
    sampling("allowed-id-uint32-max", "outside the vocabulary", allowed_token_ids=[UINT32_MAX]),
    sampling("logit-bias-key-at-vocab", "outside the vocabulary", logit_bias={VOCAB_SIZE: 1.0}),
    sampling("logit-bias-nan", "logit_bias values must be finite", logit_bias={5: NAN}),
    sampling("logit-bias-inf", "logit_bias values must be finite", logit_bias={5: INF}),
    sampling("logit-bias-minus-inf", "logit_bias values must be finite", logit_bias={5: -INF}),
    sampling("logit-bias-5000-keys", "at most 4096", logit_bias=dict.fromkeys(range(5000), 1.0)),
]

MALFORMED_CASES = [
    Case(f"{rpc}-{name}", rpc, payload, INVALID, "malformed")
    for rpc, name, payload in [
        ("Generate", "truncated", TRUNCATED),
        ("Generate", "bad-utf8", BAD_UTF8),
        ("Generate", "bad-nested-message", BAD_NESTED),
        ("Generate", "garbage", GARBAGE),
        ("Tokenize", "truncated", _wire(1, 2, b"\x05ab")),
        ("Tokenize", "bad-utf8", _wire(1, 2, b"\x01\xff")),
        ("Detokenize", "truncated", _wire(1, 2, b"\x09\x01")),
        ("Detokenize", "garbage", GARBAGE),
        ("GetModelInfo", "truncated", _wire(7, 2, b"\x05ab")),
        ("GetModelInfo", "garbage", GARBAGE),
    ]
]


def tokenize(**fields: Any) -> gen_pb2.TokenizeRequest:
    return gen_pb2.TokenizeRequest(**fields)


def detokenize(token_ids: list[int]) -> gen_pb2.DetokenizeRequest:
    return gen_pb2.DetokenizeRequest(token_ids=token_ids)


OTHER_RPC_CASES = [
    # A field of the wrong wire type is an unknown field to protobuf: the request has no prompt.
    Case("Generate-wrong-wire-type", "Generate", WRONG_WIRE_TYPE, INVALID, "no prompt given"),
    Case("tokenize-nothing", "Tokenize", tokenize(), INVALID, "set `prompt` text or `chat`"),
    Case(
        "tokenize-chat-empty",
        "Tokenize",
        tokenize(chat=gen_pb2.Chat()),
        INVALID,
        "chat has no messages",
        "chat",
    ),
    Case(
        "tokenize-100k-chars",
        "Tokenize",
        tokenize(prompt="x" * 100_000),
        INVALID,
        "more than any prompt",
        "prompt",
    ),
    Case(
        "tokenize-chat-1mb",
        "Tokenize",
        tokenize(
            chat=gen_pb2.Chat(messages=[gen_pb2.ChatMessage(role="user", content="y" * 10**6)])
        ),
        INVALID,
        "more than any prompt",
        "chat",
    ),
    Case("tokenize-5mib", "Tokenize", tokenize(prompt=FIVE_MIB_TEXT), TOO_BIG, "larger than max"),
    Case(
        "detokenize-id-at-vocab",
        "Detokenize",
        detokenize([VOCAB_SIZE]),
        INVALID,
        "outside the vocabulary",
        "token_ids",
    ),
    Case(
        "detokenize-id-uint32-max",
        "Detokenize",
        detokenize([UINT32_MAX]),
        INVALID,
        "outside the vocabulary",
        "token_ids",
    ),
    Case(
        "detokenize-over-max-model-len",
        "Detokenize",
        detokenize([5] * (MAX_MODEL_LEN + 1)),
        INVALID,
        "at most max_model_len",
        "token_ids",
    ),
    Case(
        "detokenize-1m-ids",
        "Detokenize",
        detokenize([5] * 1_000_000),
        INVALID,
        "at most max_model_len",
        "token_ids",
    ),
]

REFUSED = PROMPT_CASES + SAMPLING_CASES + MALFORMED_CASES + OTHER_RPC_CASES

ACCEPTED = {
    "top-k-vocab-plus-one": gen(top_k=VOCAB_SIZE + 1, max_tokens=4),
    "top-k-5000-top-p-0.9": gen(top_k=5000, top_p=0.9, max_tokens=4),
    "top-k-int32-max": gen(top_k=INT32_MAX, max_tokens=4),
    "top-k-minus-one": gen(top_k=-1, max_tokens=4),
    "seed-int64-max-n-3": gen(seed=INT64_MAX, n=3, temperature=1.0, max_tokens=4),
    "seed-int64-min": gen(seed=INT64_MIN, temperature=1.0, max_tokens=4),
    "temperature-1e-30": gen(temperature=1e-30, max_tokens=4),
    "temperature-3e38": gen(temperature=3e38, max_tokens=4),
    "top-p-1e-30": gen(top_p=1e-30, temperature=1.0, max_tokens=4),
    "min-p-one": gen(min_p=1.0, temperature=1.0, max_tokens=4),
    "repetition-penalty-100": gen(repetition_penalty=100.0, max_tokens=4),
    "repetition-penalty-1e-30": gen(repetition_penalty=1e-30, max_tokens=4),
    "penalties-at-their-bounds": gen(presence_penalty=2.0, frequency_penalty=-2.0, max_tokens=4),
    "logit-bias-1e30-clamped": gen(logit_bias={5: 1e30, 6: -1e30}, max_tokens=4),
    "logit-bias-whole-vocab": gen(logit_bias=dict.fromkeys(range(VOCAB_SIZE), -1.0), max_tokens=4),
    "logprobs-20-prompt-logprobs-20": gen(logprobs=20, prompt_logprobs=20, max_tokens=2),
    "n-64": gen(n=64, temperature=1.0, max_tokens=1),
    "stop-32-strings-of-256": gen(stop=["z" * 255 + str(i % 10) for i in range(32)], max_tokens=4),
    "stop-token-ids-4096": gen(stop_token_ids=[7] * 4096, max_tokens=4),
    "min-tokens-equals-max-tokens": gen(min_tokens=4, max_tokens=4),
    "prompt-max-model-len-minus-one": ids([5] * (MAX_MODEL_LEN - 1), max_tokens=1),
    "request-id-256": with_fields(gen(max_tokens=4), request_id="r" * 256),
    "cache-salt-256": with_fields(gen(max_tokens=4), cache_salt="s" * 256),
    "priority-int32-min": with_fields(gen(max_tokens=4), priority=INT32_MIN),
    "add-special-tokens-false": with_fields(gen(max_tokens=4), add_special_tokens=False),
    "served-model-name": with_fields(gen(max_tokens=4), model="tiny-llama-v1"),
    "nul-and-emoji-prompt": gen("\x00 \u2603 \U0001f600 \ufffd", max_tokens=4),
    "chat-unknown-role": chat(("robot", "beep"), max_tokens=4),
    "chat-empty-turn": chat(("", ""), max_tokens=4),
    "chat-template-syntax-is-data": chat(("user", "{{ 7*7 }}{% raw %}"), max_tokens=4),
}
"""Edges that must be served (vLLM serves them): each completes normally."""

"""The bad-input table of the OpenAI HTTP API, against the tiny model: the gRPC table's cases
(public_cases.py) as an HTTP client sends them, plus what only JSON can carry (oversized integers,
lone surrogates, wrong types, deep nesting) on every route. Each row of REFUSED is one case of
test_http_bad_input.py; ACCEPTED holds the edges that must be served, as over gRPC."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tests.reliability.public_cases import (
    INT32_MAX,
    INT32_MIN,
    INT64_MAX,
    INT64_MIN,
    MAX_MODEL_LEN,
    UINT32_MAX,
    VOCAB_SIZE,
)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
TOKENIZE, DETOKENIZE, MODELS = "/tokenize", "/detokenize", "/v1/models"
MAX_FAN_OUT = 1024
"""--max-fan-out's default."""
MAX_BODY_BYTES = 4 * 1024 * 1024
"""The body cap: --max-receive-message-bytes' default, as on gRPC."""
HUGE_INT = b"9" * 100_000
"""An integer past Python's 4300-digit conversion limit."""


@dataclass(frozen=True)
class HttpCase:
    """One call and what it must get: `status`, `fragment` in the OpenAI error's message and
    `param` as the error's `param` (None: no field is at fault)."""

    id: str
    path: str
    body: Any
    """A JSON value (sent as JSON), or bytes sent as they are."""
    status: int
    fragment: str
    param: str | None = None
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)


def cmpl(id: str, fragment: str, param: str | None, status: int = 400, **body: Any) -> HttpCase:
    """A /v1/completions call: prompt "hi" and max_tokens 4 unless `body` sets them."""
    return HttpCase(
        id, COMPLETIONS, {"prompt": "hi", "max_tokens": 4, **body}, status, fragment, param
    )


def chat(id: str, fragment: str, param: str | None, status: int = 400, **body: Any) -> HttpCase:
    """A /v1/chat/completions call: one user message and max_tokens 4 unless `body` sets them."""
    messages = [{"role": "user", "content": "hi"}]
    full = {"messages": messages, "max_tokens": 4, **body}
    return HttpCase(id, CHAT, full, status, fragment, param)


def raw(id: str, path: str, body: bytes, fragment: str, param: str | None = None) -> HttpCase:
    return HttpCase(id, path, body, 400, fragment, param)


def sampling(id: str, fragment: str, **params: Any) -> HttpCase:
    """A completions call whose sampling fields break a rule: `param` names the first field."""
    return cmpl(id, fragment, next(iter(params)), **params)


PROMPT_CASES = [
    cmpl("no-prompt", "`prompt` is required", "prompt", prompt=None),
    cmpl("empty-text", "prompt is empty", "prompt", prompt=""),
    cmpl("empty-list", "empty list", "prompt", prompt=[]),
    cmpl("empty-ids-in-list", "prompt_token_ids is empty", "prompt", prompt=[[]]),
    cmpl("id-at-vocab", "outside the vocabulary", "prompt", prompt=[VOCAB_SIZE]),
    cmpl("id-negative", "outside the vocabulary", "prompt", prompt=[-1]),
    cmpl("id-uint32-max", "outside the vocabulary", "prompt", prompt=[UINT32_MAX]),
    cmpl("id-int64-max", "outside the vocabulary", "prompt", prompt=[INT64_MAX]),
    cmpl("id-late-in-prompt", "[2] = 4000", "prompt", prompt=[5, 6, 4000]),
    cmpl("id-float", "must be a string", "prompt", prompt=[5.5]),
    cmpl("id-bool", "must be a string", "prompt", prompt=[True]),
    cmpl("text-and-ids", "must be a string", "prompt", prompt=["a", 1]),
    cmpl("id-list-holds-text", "must be an integer", "prompt", prompt=[[1, "a"]]),
    cmpl("prompt-a-number", "must be a list", "prompt", prompt=5),
    cmpl("prompt-an-object", "must be a list", "prompt", prompt={"text": "hi"}),
    cmpl("ids-fill-max-model-len", "max_model_len is", "prompt", prompt=[5] * MAX_MODEL_LEN),
    cmpl("ids-100k", "max_model_len is", "prompt", prompt=[5] * 100_000),
    cmpl("text-tokens-over-max-model-len", "max_model_len is", "prompt", prompt="river " * 3000),
    cmpl("text-100k-chars", "more than any prompt", "prompt", prompt="x" * 100_000),
    cmpl("text-5mib", "the body is over 4194304 bytes", None, 413, prompt="word " * (1 << 20)),
    cmpl("prompt-list-10k", "at most 1024 per call", "prompt", prompt=["x"] * 10_000),
    cmpl("fan-out-513-x-2", "1026 engine requests", "prompt", prompt=["x"] * 513, n=2),
    cmpl("one-over-max-model-len-in-a-list", "max_model_len is", "prompt",
         prompt=["hi", "river " * 3000]),
    cmpl("model-unknown", "does not exist", None, 404, model="nope"),
    cmpl("model-wrong-case", "does not exist", None, 404, model="TINY-LLAMA-V1"),
    cmpl("model-name-1mb", "(1000000 characters)", None, 404, model="m" * 1_000_000),
    cmpl("model-a-number", "`model` must be a string", "model", model=5),
    cmpl("request-id-257", "at most 256", "request_id", request_id="r" * 257),
    cmpl("request-id-1mb", "at most 256", "request_id", request_id="r" * 10**6),
    cmpl("request-id-a-number", "must be a string", "request_id", request_id=7),
    cmpl("cache-salt-257", "at most 256", "cache_salt", cache_salt="s" * 257),
    cmpl("cache-salt-a-list", "must be a string", "cache_salt", cache_salt=["s"]),
    cmpl("priority-int32-max-plus-one", "must be in [-2147483648", "priority",
         priority=INT32_MAX + 1),
    cmpl("priority-int64-max", "must be in [-2147483648", "priority", priority=INT64_MAX),
    cmpl("priority-fraction", "must be an integer", "priority", priority=1.5),
    cmpl("echo-a-string", "true or false", "echo", echo="yes"),
    cmpl("stream-a-string", "true or false", "stream", stream="yes"),
    cmpl("stream-options-without-stream", "needs `stream: true`", "stream_options",
         stream_options={"include_usage": True}),
    cmpl("stream-options-include-usage-1", "true or false", "stream_options.include_usage",
         stream=True, stream_options={"include_usage": 1}),
    cmpl("add-special-tokens-a-string", "true or false", "add_special_tokens",
         add_special_tokens="no"),
]  # fmt: skip

UNSUPPORTED_CASES = [
    cmpl(f"unsupported-{name}", "not supported", name, **{name: value})
    for name, value in [
        ("suffix", "x"),
        ("best_of", 2),
        ("use_beam_search", True),
        ("tools", [{"type": "function"}]),
        ("prompt_embeds", "AAAA"),
        ("logits_processors", ["x"]),
        ("truncate_prompt_tokens", 5),
        ("kv_transfer_params", {"a": 1}),
    ]
]

SAMPLING_CASES = [
    sampling("n-65", "n must be in [1, 64]", n=65, temperature=1.0),
    sampling("n-uint32-max", "n must be in [1, 64]", n=UINT32_MAX, temperature=1.0),
    sampling("n-int64-max", "n must be in [1, 64]", n=INT64_MAX, temperature=1.0),
    sampling("n-2-pow-100", "n must be in [1, 64]", n=2**100, temperature=1.0),
    sampling("n-zero", "n must be in [1, 64]", n=0),
    sampling("n-negative", "n must be in [1, 64]", n=-3),
    sampling("n-fraction", "must be an integer", n=1.5),
    sampling("n-a-string", "must be an integer", n="2"),
    sampling("n-greedy", "identical", n=2, temperature=0.0),
    sampling("temperature-negative", "temperature must be finite", temperature=-1.0),
    sampling("temperature-a-string", "must be a number", temperature="hot"),
    sampling("temperature-1e39", "too large", temperature=1e39),
    raw(
        "temperature-1e400",
        COMPLETIONS,
        b'{"prompt": "hi", "temperature": 1e400}',
        "must be a finite number",
        "temperature",
    ),
    sampling("temperature-int-400-digits", "too large", temperature=10**400),
    sampling("top-p-zero", "top_p must be in (0, 1]", top_p=0.0),
    sampling("top-p-above-one", "top_p must be in (0, 1]", top_p=1.5),
    sampling("top-p-1e-130-is-zero-in-float32", "top_p must be in (0, 1]", top_p=1.8e-130),
    sampling("top-k-minus-two", "top_k must be -1", top_k=-2),
    sampling("top-k-int32-min", "top_k must be -1", top_k=INT32_MIN),
    sampling("top-k-1e30", "top_k must be -1", top_k=1e30),
    sampling("min-p-above-one", "min_p must be in [0, 1]", min_p=1.5),
    sampling("min-p-negative", "min_p must be in [0, 1]", min_p=-0.1),
    sampling("presence-penalty-2.5", "presence_penalty must be in [-2, 2]", presence_penalty=2.5),
    sampling("frequency-penalty-minus-3", "frequency_penalty must be in", frequency_penalty=-3.0),
    sampling("repetition-penalty-zero", "repetition_penalty must be in", repetition_penalty=0.0),
    sampling("repetition-penalty-negative", "repetition_penalty must", repetition_penalty=-1.0),
    sampling("repetition-penalty-1e30", "repetition_penalty must be in", repetition_penalty=1e30),
    sampling("max-tokens-zero", "max_tokens must be >= 1", max_tokens=0),
    sampling("max-tokens-negative", "max_tokens must be >= 1", max_tokens=-1),
    sampling("max-tokens-uint32-max", "exceeds max_model_len", max_tokens=UINT32_MAX),
    sampling("max-tokens-max-model-len", "exceeds max_model_len", max_tokens=MAX_MODEL_LEN),
    sampling("max-tokens-int64-max", "max_tokens must be <= 4294967295", max_tokens=INT64_MAX),
    sampling("max-tokens-a-string", "must be an integer", max_tokens="5"),
    sampling("min-tokens-uint32-max", "must not exceed max_tokens", min_tokens=UINT32_MAX),
    sampling("min-tokens-above-max-tokens", "must not exceed", min_tokens=9, max_tokens=3),
    sampling("min-tokens-negative", "min_tokens must be >= 0", min_tokens=-1),
    sampling("logprobs-21", "logprobs must be in [0, 20]", logprobs=21),
    sampling("logprobs-negative", "logprobs must be in [0, 20]", logprobs=-1),
    sampling("logprobs-int64-max", "logprobs must be in [0, 20]", logprobs=INT64_MAX),
    sampling("prompt-logprobs-21", "prompt_logprobs must be in", prompt_logprobs=21),
    sampling("prompt-logprobs-negative", "prompt_logprobs must be in", prompt_logprobs=-5),
    sampling("seed-int64-max-plus-one", "seed must be <=", seed=INT64_MAX + 1),
    sampling("seed-int64-min-minus-one", "seed must be >=", seed=INT64_MIN - 1),
    sampling("stop-33-strings", "at most 32", stop=["a"] * 33),
    sampling("stop-empty-string", "stop[0] must have", stop=[""]),
    sampling("stop-257-chars", "stop[0] must have", stop=["s" * 257]),
    sampling("stop-not-text", "must be a string", stop=[1]),
    sampling("stop-token-id-at-vocab", "outside the vocabulary", stop_token_ids=[VOCAB_SIZE]),
    sampling("stop-token-id-negative", "outside the vocabulary", stop_token_ids=[-1]),
    sampling("stop-token-ids-5000", "at most 4096", stop_token_ids=[5] * 5000),
    sampling("allowed-id-at-vocab", "outside the vocabulary", allowed_token_ids=[VOCAB_SIZE]),
    sampling("allowed-id-negative", "outside the vocabulary", allowed_token_ids=[-7]),
    sampling("logit-bias-key-at-vocab", "outside the vocabulary", logit_bias={"2048": 1.0}),
    sampling("logit-bias-key-not-an-id", "must be token ids", logit_bias={"abc": 1.0}),
    sampling("logit-bias-key-5000-digits", "(5000 characters)", logit_bias={"1" * 5000: 1}),
    sampling("logit-bias-value-a-string", "must be a number", logit_bias={"5": "x"}),
    sampling("logit-bias-value-1e39", "too large", logit_bias={"5": 1e39}),
    sampling("logit-bias-5000-keys", "at most 4096", logit_bias={str(i): 1.0 for i in range(5000)}),
    sampling("ignore-eos-a-string", "true or false", ignore_eos="yes"),
    sampling("skip-special-tokens-1", "true or false", skip_special_tokens=1),
]

CHAT_CASES = [
    chat("chat-no-messages", "`messages` is required", "messages", messages=None),
    chat("chat-messages-empty", "`messages` is empty", "messages", messages=[]),
    chat("chat-messages-a-string", "must be a list", "messages", messages="hi"),
    chat("chat-message-a-string", "must be an object", "messages[0]", messages=["hi"]),
    chat("chat-no-role", "has no `role`", "messages[0]", messages=[{"content": "x"}]),
    chat("chat-role-a-number", "must be a string", "messages[0].role",
         messages=[{"role": 5, "content": "x"}]),
    chat("chat-content-a-number", "must be a list", "messages[0].content",
         messages=[{"role": "user", "content": 5}]),
    chat("chat-part-unknown-type", "unknown content part type", "messages[0].content",
         messages=[{"role": "user", "content": [{"type": "video"}]}]),
    chat("chat-part-audio", "not supported", "messages[0].content[0]",
         messages=[{"role": "user", "content": [{"type": "input_audio"}]}]),
    chat("chat-part-text-a-number", "must be a string", "messages[0].content[0].text",
         messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
    chat("chat-image-without-url", "needs a `url`", "messages[0].content[0].image_url",
         messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
    chat("chat-image-on-a-text-model", "takes text only", "messages[0].content[0].image_url",
         messages=[{"role": "user", "content": [
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]),
    chat("chat-1mb", "more than any prompt", "messages",
         messages=[{"role": "user", "content": "y" * 1_000_000}]),
    chat("chat-over-max-model-len", "max_model_len is", "messages",
         messages=[{"role": "user", "content": "stone " * 3000}]),
    chat("chat-echo", "not supported on this endpoint", "echo", echo=True),
    chat("chat-logprobs-a-number", "true or false", "logprobs", logprobs=5),
    chat("chat-top-logprobs-without-logprobs", "needs `logprobs: true`", "top_logprobs",
         top_logprobs=2),
    chat("chat-top-logprobs-21", "logprobs must be in [0, 20]", "top_logprobs", logprobs=True,
         top_logprobs=21),
    chat("chat-top-logprobs-int64-max", "logprobs must be in [0, 20]", "top_logprobs",
         logprobs=True, top_logprobs=INT64_MAX),
    chat("chat-n-int64-max", "n must be in [1, 64]", "n", n=INT64_MAX, temperature=1.0),
    chat("chat-max-completion-tokens-zero", "max_tokens must be >= 1", "max_completion_tokens",
         max_completion_tokens=0),
    chat("chat-max-completion-tokens-int64-max", "max_tokens must be <=",
         "max_completion_tokens", max_completion_tokens=INT64_MAX),
    chat("chat-continue-and-add-generation-prompt", "cannot both be true",
         "continue_final_message", continue_final_message=True),
    chat("chat-template-kwargs-tokenize", "may not set tokenize", "chat_template_kwargs",
         chat_template_kwargs={"tokenize": True}),
    chat("chat-template-kwargs-a-list", "must be an object", "chat_template_kwargs",
         chat_template_kwargs=[1]),
    chat("chat-template-from-the-request", "not supported", "chat_template",
         chat_template="{{ 1 }}"),
    chat("chat-tools-without-function", "must be an object", "tools[0].function",
         tools=[{"type": "function"}]),
    chat("chat-tools-bad-name", "1 to 64 letters", "tools[0].function.name",
         tools=[{"type": "function", "function": {"name": "a b"}}]),
    chat("chat-tools-parameters-not-object", "must be a JSON Schema of an object",
         "tools[0].function.parameters",
         tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]),
    chat("chat-tools-empty", "must not be an empty array", "tools", tools=[]),
    chat("chat-tool-choice-without-tools", "`tools` must be set", "tool_choice",
         tool_choice="required"),
    chat("chat-tool-choice-unknown-function", "does not match any", "tool_choice",
         tools=[{"type": "function", "function": {"name": "f"}}],
         tool_choice={"type": "function", "function": {"name": "g"}}),
    chat("chat-tool-choice-auto-without-parser", "--enable-auto-tool-choice", "tool_choice",
         tools=[{"type": "function", "function": {"name": "f"}}]),
    chat("chat-tool-call-arguments-not-json", "is not valid JSON",
         "messages[0].tool_calls[0].function.arguments",
         messages=[{"role": "assistant", "tool_calls": [
             {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{x"}}]}]),
]  # fmt: skip

JSON_CASES = [
    raw("not-json", COMPLETIONS, b"{not json", "not valid JSON"),
    raw("not-an-object", COMPLETIONS, b"[1, 2]", "JSON object"),
    raw("nan-literal", COMPLETIONS, b'{"prompt": "x", "temperature": NaN}', "NaN"),
    raw("infinity-literal", COMPLETIONS, b'{"prompt": "x", "top_p": Infinity}', "Infinity"),
    raw("deep-nesting", COMPLETIONS, b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
    raw("deep-nesting-in-a-field", CHAT,
        b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a": '
        + b"[" * 100_000 + b"]" * 100_000 + b"}}", "not valid JSON"),
    raw("not-utf8", COMPLETIONS, b'{"prompt": "\xff\xfe"}', "not valid JSON"),
    raw("utf8-encoded-surrogate", COMPLETIONS, b'{"prompt": "\xed\xa0\x80"}', "lone UTF-16",
        "prompt"),
    raw("lone-surrogate-prompt", COMPLETIONS, b'{"prompt": "\\ud800"}', "lone UTF-16", "prompt"),
    raw("lone-surrogate-in-a-prompt-list", COMPLETIONS, b'{"prompt": ["a", "b\\udc00"]}',
        "lone UTF-16", "prompt"),
    raw("lone-surrogate-stop", COMPLETIONS, b'{"prompt": "x", "stop": "\\udbff"}', "lone UTF-16",
        "stop"),
    raw("lone-surrogate-chat", CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        "lone UTF-16", "messages"),
    raw("lone-surrogate-request-id", COMPLETIONS, b'{"prompt": "x", "request_id": "\\ud800"}',
        "lone UTF-16", "request_id"),
    raw("lone-surrogate-in-an-unknown-field", COMPLETIONS, b'{"prompt": "x", "user": "\\ud800"}',
        "lone UTF-16", "user"),
    raw("huge-int-max-tokens", COMPLETIONS, b'{"prompt": "x", "max_tokens": ' + HUGE_INT + b"}",
        "more than 4300 digits", "max_tokens"),
    raw("huge-int-n", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "n": -'
        + HUGE_INT + b"}", "more than 4300 digits", "n"),
    raw("huge-int-token-id", COMPLETIONS, b'{"prompt": [1, ' + HUGE_INT + b"]}",
        "more than 4300 digits", "prompt"),
    raw("huge-int-detokenize", DETOKENIZE, b'{"tokens": [' + HUGE_INT + b"]}",
        "more than 4300 digits", "tokens"),
    HttpCase("unknown-route", "/v1/nothing", {}, 404, "Not Found"),
    HttpCase("wrong-method", COMPLETIONS, None, 405, "Method Not Allowed", method="GET"),
    HttpCase("models-post", MODELS, {}, 405, "Method Not Allowed"),
    HttpCase("models-unknown-id", MODELS + "/gpt-4", None, 404, "Not Found", method="GET"),
    HttpCase("length-over-the-limit", COMPLETIONS, b"", 413, "the body is over"),
    HttpCase("chunked-over-the-limit", COMPLETIONS, b"", 413, "the body is over"),
    HttpCase("x-request-id-over-256", COMPLETIONS, {"prompt": "x"}, 400,
             "the x-request-id header has 300 characters; at most 256",
             headers={"x-request-id": "r" * 300}),
]  # fmt: skip

TOKENIZER_CASES = [
    HttpCase("tokenize-nothing", TOKENIZE, {}, 400, "send `prompt` text", "prompt"),
    HttpCase("tokenize-prompt-a-list", TOKENIZE, {"prompt": [1]}, 400, "must be a string", "prompt"),
    HttpCase("tokenize-100k-chars", TOKENIZE, {"prompt": "x" * 100_000}, 400,
             "more than any prompt", "prompt"),
    HttpCase("tokenize-5mib", TOKENIZE, {"prompt": "word " * (1 << 20)}, 413, "the body is over"),
    HttpCase("tokenize-chat-empty", TOKENIZE, {"messages": []}, 400, "`messages` is empty",
             "messages"),
    HttpCase("tokenize-chat-1mb", TOKENIZE,
             {"messages": [{"role": "user", "content": "y" * 1_000_000}]}, 400,
             "more than any prompt", "messages"),
    HttpCase("tokenize-chat-template-kwargs-tokenize", TOKENIZE,
             {"messages": [{"role": "user", "content": "x"}],
              "chat_template_kwargs": {"tokenize": True}}, 400, "may not set tokenize",
             "chat_template_kwargs"),
    HttpCase("tokenize-model-unknown", TOKENIZE, {"prompt": "x", "model": "nope"}, 404,
             "does not exist"),
    HttpCase("tokenize-lone-surrogate", TOKENIZE, b'{"prompt": "\\udfff"}', 400, "lone UTF-16",
             "prompt"),
    HttpCase("detokenize-id-at-vocab", DETOKENIZE, {"tokens": [VOCAB_SIZE]}, 400,
             "outside the vocabulary", "tokens"),
    HttpCase("detokenize-id-negative", DETOKENIZE, {"tokens": [5, -1]}, 400, "tokens[1] = -1",
             "tokens"),
    HttpCase("detokenize-id-int64-max", DETOKENIZE, {"tokens": [INT64_MAX]}, 400,
             "outside the vocabulary", "tokens"),
    HttpCase("detokenize-over-max-model-len", DETOKENIZE, {"tokens": [5] * (MAX_MODEL_LEN + 1)},
             400, "at most max_model_len", "tokens"),
    HttpCase("detokenize-1m-ids", DETOKENIZE, {"tokens": [5] * 1_000_000}, 400,
             "at most max_model_len", "tokens"),
    HttpCase("detokenize-6m-ids", DETOKENIZE, {"tokens": [5] * 6_000_000}, 413,
             "the body is over"),
    HttpCase("detokenize-tokens-a-string", DETOKENIZE, {"tokens": "5"}, 400, "must be a list",
             "tokens"),
    HttpCase("detokenize-id-fraction", DETOKENIZE, {"tokens": [1.5]}, 400, "must be an integer",
             "tokens"),
    HttpCase("detokenize-model-unknown", DETOKENIZE, {"tokens": [5], "model": "nope"}, 404,
             "does not exist"),
]  # fmt: skip

REFUSED = (
    PROMPT_CASES + UNSUPPORTED_CASES + SAMPLING_CASES + CHAT_CASES + JSON_CASES + TOKENIZER_CASES
)


@dataclass(frozen=True)
class Accepted:
    """A call that must be served: 200 and `num_choices` choices, each finished."""

    path: str
    body: dict[str, Any]
    num_choices: int = 1


def ok(num_choices: int = 1, **body: Any) -> Accepted:
    return Accepted(COMPLETIONS, {"prompt": "hi", "max_tokens": 4, **body}, num_choices)


def ok_chat(num_choices: int = 1, **body: Any) -> Accepted:
    messages = [{"role": "user", "content": "hi"}]
    return Accepted(CHAT, {"messages": messages, "max_tokens": 4, **body}, num_choices)


ACCEPTED = {
    "top-k-vocab-plus-one": ok(top_k=VOCAB_SIZE + 1),
    "top-k-5000-top-p-0.9": ok(top_k=5000, top_p=0.9),
    "top-k-int32-max": ok(top_k=INT32_MAX),
    "top-k-minus-one": ok(top_k=-1),
    "seed-int64-max-n-3": ok(3, seed=INT64_MAX, n=3, temperature=1.0),
    "seed-int64-min": ok(seed=INT64_MIN, temperature=1.0),
    "temperature-1e-30": ok(temperature=1e-30),
    "temperature-3e38": ok(temperature=3e38),
    "top-p-1e-30": ok(top_p=1e-30, temperature=1.0),
    "min-p-one": ok(min_p=1.0, temperature=1.0),
    "repetition-penalty-100": ok(repetition_penalty=100.0),
    "repetition-penalty-1e-30": ok(repetition_penalty=1e-30),
    "penalties-at-their-bounds": ok(presence_penalty=2.0, frequency_penalty=-2.0),
    "logit-bias-1e30-clamped": ok(logit_bias={"5": 1e30, "6": -1e30}),
    "logit-bias-whole-vocab": ok(logit_bias={str(i): -1.0 for i in range(VOCAB_SIZE)}),
    "logprobs-20-prompt-logprobs-20": ok(logprobs=20, prompt_logprobs=20, max_tokens=2),
    "n-64": ok(64, n=64, temperature=1.0, max_tokens=1),
    "stop-32-strings-of-256": ok(stop=["z" * 255 + str(i % 10) for i in range(32)]),
    "stop-token-ids-4096": ok(stop_token_ids=[7] * 4096),
    "min-tokens-equals-max-tokens": ok(min_tokens=4),
    "prompt-max-model-len-minus-one": ok(prompt=[5] * (MAX_MODEL_LEN - 1), max_tokens=1),
    "request-id-256": ok(request_id="r" * 256),
    "cache-salt-256": ok(cache_salt="s" * 256),
    "priority-int32-min": ok(priority=INT32_MIN),
    "add-special-tokens-false": ok(add_special_tokens=False),
    "served-model-name": ok(model="tiny-llama-v1"),
    "nul-and-emoji-prompt": ok(prompt="\x00 \u2603 \U0001f600 \ufffd"),
    "nulls-mean-unset": ok(stop=None, seed=None, n=None, logit_bias=None, user=None),
    "unknown-fields-ignored": ok(frobnicate={"a": [1, 2]}, user="u", metadata={"k": "v"}),
    "prompts-4-x-n-2": ok(8, prompt=["a", "b", "c", "d"], n=2, temperature=1.0),
    "token-id-prompts-2": ok(2, prompt=[[5, 6], [7]]),
    "fan-out-at-the-cap": ok(MAX_FAN_OUT, prompt=[[5]] * (MAX_FAN_OUT // 2), n=2,
                             temperature=1.0, max_tokens=1),
    "echo-with-logprobs": ok(echo=True, logprobs=1),
    "chat-unknown-role": ok_chat(messages=[{"role": "robot", "content": "beep"}]),
    "chat-empty-turn": ok_chat(messages=[{"role": "", "content": ""}]),
    "chat-template-syntax-is-data": ok_chat(
        messages=[{"role": "user", "content": "{{ 7*7 }}{% raw %}"}]),
    "chat-n-3-top-logprobs-20": ok_chat(3, n=3, temperature=1.0, logprobs=True, top_logprobs=20),
    "chat-max-completion-tokens": ok_chat(max_completion_tokens=2, max_tokens=None),
}  # fmt: skip
"""Edges that must be served (the gRPC table's, and HTTP's own): each completes normally."""

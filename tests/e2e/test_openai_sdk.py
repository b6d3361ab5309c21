"""The official `openai` SDK, sync and async, against a real stack's HTTP port: completions,
chat, n > 1, logprobs, stop strings, usage, and the SDK's exception classes. Greedy output over
HTTP equals the gRPC output and transformers'."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import grpc
import openai
import pytest

from splitserve.children import stop_children
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc
from tests.e2e.client import generate, text_request
from tests.e2e.stack import Stack
from tests.e2e.test_generate import PROMPT, hf_greedy

pytestmark = pytest.mark.slow
MODEL = "tiny-llama-v1"
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def client(stack: Stack, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http}/v1", api_key=key, max_retries=0, timeout=120)


def test_greedy_over_http_equals_grpc_and_transformers(
    stack: Stack, hf_model: Any, tokenizer: Any
) -> None:
    expected_ids = hf_greedy(hf_model, tokenizer.encode(PROMPT), 24)
    expected = tokenizer.decode(expected_ids, skip_special_tokens=True)
    over_grpc = generate(
        stack.frontend, text_request(PROMPT, temperature=0.0, max_tokens=24, ignore_eos=True)
    )[0]
    reply = client(stack).completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, **GREEDY)
    assert reply.choices[0].text == over_grpc.text == expected
    assert over_grpc.token_ids == expected_ids
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (
        len(tokenizer.encode(PROMPT)),
        24,
    )
    by_ids = client(stack).completions.create(
        model=MODEL, prompt=tokenizer.encode(PROMPT), max_tokens=24, **GREEDY
    )
    assert by_ids.choices[0].text == expected


def test_streaming_sends_one_chunk_per_token_and_usage_last(stack: Stack, tokenizer: Any) -> None:
    chunks = list(
        client(stack).completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    token_chunks, last = chunks[:-1], chunks[-1]
    assert len(token_chunks) == 20
    assert all(c.usage is None for c in token_chunks)
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        len(tokenizer.encode(PROMPT)),
        20,
    )
    text = "".join(c.choices[0].text for c in token_chunks)
    whole = client(stack).completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, **GREEDY)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in token_chunks][-2:] == [None, "length"]


def test_chat_sync_and_streaming_agree(stack: Stack) -> None:
    messages: Any = [{"role": "system", "content": ""}, {"role": "user", "content": "Hello"}]
    reply = client(stack).chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=12, **GREEDY
    )
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage is not None and reply.usage.completion_tokens == 12
    stream = client(stack).chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks[1:] if c.choices]
    assert len(content) == 12  # one chunk per token after the role chunk
    assert (
        "".join(c.choices[0].delta.content or "" for c in content)
        == reply.choices[0].message.content
    )
    assert content[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_n_choices_each_stream_their_own_chunks(stack: Stack) -> None:
    kwargs: Any = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "n": 3, "seed": 7}
    kwargs["temperature"], kwargs["extra_body"] = 0.9, {"ignore_eos": True}
    reply = client(stack).completions.create(**kwargs)
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    assert reply.usage is not None and reply.usage.completion_tokens == 18
    texts: dict[int, str] = {0: "", 1: "", 2: ""}
    counts = dict.fromkeys(texts, 0)
    for chunk in client(stack).completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            counts[choice.index] += 1
    assert counts == {0: 6, 1: 6, 2: 6}
    assert texts == {c.index: c.text for c in reply.choices}  # seeded: the same completions


def test_logprobs_completions_and_chat(stack: Stack) -> None:
    reply = client(stack).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, logprobs=3, **GREEDY
    )
    lp = reply.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == 5
    assert "".join(lp.tokens) == reply.choices[0].text
    assert lp.top_logprobs is not None and all(3 <= len(d) <= 4 for d in lp.top_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(
        max(d.values()) == pytest.approx(v)
        for d, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    chat = client(stack).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    assert all(len(e.top_logprobs) == 2 for e in content)
    assert "".join(e.token for e in content) == chat.choices[0].message.content


def test_echo_with_logprobs_gives_prompt_logprobs(stack: Stack, tokenizer: Any) -> None:
    reply = client(stack).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, logprobs=1, echo=True, **GREEDY
    )
    choice = reply.choices[0]
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None
    num_prompt = len(tokenizer.encode(PROMPT))
    assert len(lp.token_logprobs) == num_prompt + 2
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])


def test_stop_string_ends_the_text_before_it(stack: Stack) -> None:
    whole = client(stack).completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, **GREEDY)
    text = whole.choices[0].text
    stop = text[5:8]
    reply = client(stack).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=20, stop=[stop], **GREEDY
    )
    assert reply.choices[0].text == text[: text.index(stop)]
    assert reply.choices[0].finish_reason == "stop"
    streamed = client(stack).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=20, stop=stop, stream=True, **GREEDY
    )
    assert "".join(c.choices[0].text for c in streamed) == reply.choices[0].text


def test_async_client_streams_concurrent_requests(stack: Stack) -> None:
    async def main() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=f"{stack.http}/v1", api_key="x", max_retries=0)

        async def one(i: int) -> str:
            stream = await aclient.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"story {i}"}],
                max_tokens=8,
                stream=True,
                **GREEDY,
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        try:
            return list(await asyncio.gather(*(one(i) for i in range(6))))
        finally:
            await aclient.close()

    texts = asyncio.run(main())
    assert len(texts) == 6 and all(texts)
    alone = client(stack).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "story 3"}], max_tokens=8, **GREEDY
    )
    assert texts[3] == alone.choices[0].message.content


def test_errors_are_the_sdks_exception_classes(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client(stack).completions.create(model=MODEL, prompt=PROMPT, temperature=-1)
    assert "temperature" in str(bad.value)
    with pytest.raises(openai.BadRequestError):
        client(stack).completions.create(model=MODEL, prompt=PROMPT, max_tokens=100000, stream=True)
    with pytest.raises(openai.NotFoundError) as missing:
        client(stack).completions.create(model="gpt-4", prompt=PROMPT)
    assert missing.value.status_code == 404 and "gpt-4" in str(missing.value)
    models = client(stack).models.list()
    assert [m.id for m in models.data] == [MODEL]


@pytest.fixture(scope="module")
def keyed_http(stack: Stack) -> Iterator[str]:
    """A second frontend on the same core, started with --api-key."""
    child = stack.add_frontend(api_key="s3cret")
    yield f"http://{child.http_address}"
    stop_children([child])


def _status(url: str, body: bytes | None = None, key: str = "") -> int:
    import urllib.error
    import urllib.request

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as err:
        return err.code


def test_api_key_is_required_on_every_route_but_the_probes(keyed_http: str) -> None:
    """/v1/* and the tokenizer routes (issue 22 row 3: /tokenize and /detokenize were open);
    /health, /ping, /version and /metrics stay open, as in vLLM."""
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed_http}/v1", api_key="wrong", max_retries=0).models.list()
    ok = openai.OpenAI(base_url=f"{keyed_http}/v1", api_key="s3cret", max_retries=0)
    reply = ok.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, **GREEDY)
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    for path, body in [("/tokenize", b'{"prompt": "hi"}'), ("/detokenize", b'{"tokens": [5]}')]:
        assert _status(f"{keyed_http}{path}", body) == 401, path
        assert _status(f"{keyed_http}{path}", body, key="wrong") == 401, path
        assert _status(f"{keyed_http}{path}", body, key="s3cret") == 200, path
    for path in ("/health", "/ping", "/version", "/metrics"):
        assert _status(f"{keyed_http}{path}") == 200, path


def test_grpc_checks_the_model_field(stack: Stack) -> None:
    with grpc.insecure_channel(stack.frontend) as channel:
        stub = gen_grpc.GenerationServiceStub(channel)
        request = gen_pb2.GenerateRequest(prompt=PROMPT, model="other-model")
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request, timeout=30))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        request.model = MODEL
        request.sampling_params.max_tokens = 2
        assert len(list(stub.Generate(request, timeout=30))) >= 1

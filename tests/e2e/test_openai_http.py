"""The HTTP API as tools other than the SDK see it: `vllm bench serve`'s client, raw sockets that
disconnect, /metrics and the small routes (bad input and fuzzing: tests/reliability)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlparse

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e import vllm_bench_client as bench
from tests.e2e.stack import Stack
from tests.e2e.test_generate import PROMPT

pytestmark = pytest.mark.slow


def post(base: str, path: str, body: Any, timeout: float = 60) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"{base}{path}", data=data, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as reply:
            raw = reply.read()
            status = reply.status
    except urllib.error.HTTPError as err:
        raw, status = err.read(), err.code
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw.decode()


def get(base: str, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"{base}{path}", timeout=30) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_what_vllm_bench_serve_sends_works(stack: Stack, tokenizer: Any, backend: str) -> None:
    async def main() -> list[bench.BenchResult]:
        model, root = await bench.first_model(stack.http)
        assert model == "tiny-llama-v1" and root == str(stack.model)
        prompts: list[str | list[int]] = [f"{PROMPT} {i}" for i in range(6)]
        if backend == "openai":
            prompts += [tokenizer.encode(f"{PROMPT} ids {i}") for i in range(2)]
        async with aiohttp.ClientSession() as session:
            return list(
                await asyncio.gather(
                    *(
                        bench.request(
                            session,
                            stack.http,
                            backend,
                            bench.payload(backend, model, p, 10 + i, ignore_eos=True),
                            f"bench-{backend}-{i}",
                        )
                        for i, p in enumerate(prompts)
                    )
                )
            )

    results = asyncio.run(main())
    for i, result in enumerate(results):
        assert result.success, result.error
        assert result.output_tokens == 10 + i  # from the trailing usage chunk
        assert result.prompt_len > 0 and result.ttft > 0
        # one chunk per token; chat's first chunk (the role) counts as vLLM's TTFT
        extra = 1 if backend == "openai-chat" else 0
        assert len(result.itl) == 10 + i - 1 + extra


def scheduler_idle(stack: Stack) -> bool:
    stats = stack.scheduler_stats()
    return (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (0, 0, 0.0)


def frontend_gauges(stack: Stack) -> dict[str, float]:
    _, text = get(stack.http, "/metrics")
    wanted = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name in wanted
    }


def wait_until(predicate: Any, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def _raw_post(stack: Stack, path: str, body: dict[str, Any]) -> socket.socket:
    url = urlparse(stack.http)
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_the_kv_cache(stack: Stack, stream: bool) -> None:
    """The engine stops at the disconnect: fewer steps than the request's 1900 tokens need
    (an idle core alone would also follow a request that ran to its end)."""
    max_tokens = 1900
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    first_step = stack.scheduler_stats().step_id
    sock = _raw_post(stack, "/v1/completions", body)
    try:
        assert wait_until(lambda: stack.scheduler_stats().num_running_reqs == 1)
        received = b""
        while stream and b"data: " not in received:  # the headers may come alone first
            chunk = sock.recv(4096)
            assert chunk, received
            received += chunk
        assert wait_until(lambda: frontend_gauges(stack)["vllm:num_requests_running"] == 1)
    finally:
        sock.close()
    assert wait_until(lambda: scheduler_idle(stack), timeout=60)
    num_steps = stack.scheduler_stats().step_id - first_step
    assert num_steps < max_tokens, f"the request ran {num_steps} steps: not aborted"
    assert wait_until(lambda: sum(frontend_gauges(stack).values()) == 0.0)


def test_metrics_on_the_http_port(stack: Stack) -> None:
    post(stack.http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    status, text = get(stack.http, "/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert [s.labels for s in families[name].samples] == [
            {"model_name": "tiny-llama-v1", "engine": "0"}
        ]
    usage = families["vllm:kv_cache_usage_perc"].samples[0].value
    assert 0.0 <= usage <= 1.0
    info = families["vllm:cache_config_info"].samples[0].labels
    assert info["engine"] == "0" and info["block_size"] == "16" and int(info["num_gpu_blocks"]) > 1
    assert "vllm:time_to_first_token_seconds" in families  # the frontend's own registry


def _samples(url: str, name: str) -> dict[tuple[str, str, str], float]:
    """The `name` samples at a /metrics `url`, by (grpc_type, grpc_method, grpc_code)."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.labels["grpc_type"], s.labels["grpc_method"], s.labels.get("grpc_code", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def test_grpc_client_metrics_of_the_hops(stack: Stack) -> None:
    """The standard client metrics of each service's calls to its peer: the frontend's to the
    core on its serving /metrics, the core's to the ranks on its own."""
    post(stack.http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    started = _samples(f"{stack.http}/metrics", "grpc_client_started_total")
    assert started[("bidi_stream", "EngineStream", "")] >= 1
    handled = _samples(f"{stack.http}/metrics", "grpc_client_handled_total")
    assert handled[("unary", "Handshake", "OK")] >= 1
    core = stack.child("core").metrics_url
    assert _samples(core, "grpc_client_started_total")[("bidi_stream", "Execute", "")] >= 1
    assert _samples(core, "grpc_client_handled_total")[("unary", "LoadModel", "OK")] >= 1
    timed = _samples(core, "grpc_client_handling_seconds_count")
    assert timed[("unary", "LoadModel", "")] >= 1


def test_small_routes(stack: Stack, tokenizer: Any) -> None:
    assert get(stack.http, "/health") == (200, "")
    assert get(stack.http, "/ping")[0] == 200
    status, version = get(stack.http, "/version")
    assert status == 200 and json.loads(version)["version"]
    models = json.loads(get(stack.http, "/v1/models")[1])["data"][0]
    assert models["max_model_len"] == 2048 and models["owned_by"] == "splitserve"
    status, tok = post(stack.http, "/tokenize", {"prompt": PROMPT, "return_token_strs": True})
    assert status == 200 and tok["tokens"] == tokenizer.encode(PROMPT)
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"])
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    status, chat_tok = post(stack.http, "/tokenize", chat)
    assert status == 200 and chat_tok["count"] > 1
    status, text = post(stack.http, "/detokenize", {"tokens": tok["tokens"][1:]})
    assert status == 200 and text["prompt"] == PROMPT
    status, err = post(stack.http, "/detokenize", {"tokens": [10**9]})
    assert status == 400 and err["error"]["param"] == "tokens"


def test_errors_have_openais_shape(stack: Stack) -> None:
    for path, body, code in [
        ("/v1/completions", b"{not json", 400),
        ("/v1/completions", {"prompt": "x", "n": 0}, 400),
        ("/v1/chat/completions", {"messages": "hi"}, 400),
        ("/v1/completions", {"prompt": "x", "model": "nope"}, 404),
        ("/v1/nothing", {}, 404),
    ]:
        status, reply = post(stack.http, path, body)
        assert status == code, (path, body, reply)
        assert set(reply["error"]) == {"message", "type", "param", "code"}
        assert reply["error"]["code"] == code and reply["error"]["message"]


def sse_events(base: str, path: str, body: dict[str, Any]) -> list[Any]:
    status, raw = post(base, path, body)
    assert status == 200, raw
    messages = [m.removeprefix("data: ") for m in raw.split("\n\n") if m]
    assert messages[-1] == "[DONE]"
    return [json.loads(m) for m in messages[:-1]]


def test_continuous_usage_and_prompt_logprobs(stack: Stack, tokenizer: Any) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    events = sse_events(
        stack.http, "/v1/completions", body | {"stream": True, "stream_options": options}
    )
    num_prompt = len(tokenizer.encode(PROMPT))
    assert [e["usage"]["completion_tokens"] for e in events[:-1]] == [1, 2, 3, 4, 5]
    assert all(e["usage"]["prompt_tokens"] == num_prompt for e in events)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] == num_prompt + 5
    status, reply = post(stack.http, "/v1/completions", body | {"prompt_logprobs": 1})
    rows = reply["choices"][0]["prompt_logprobs"]
    assert status == 200 and len(rows) == num_prompt and rows[0] is None
    ids = tokenizer.encode(PROMPT)
    assert all(str(ids[i]) in row for i, row in enumerate(rows) if row is not None)


def test_chat_template_options(stack: Stack) -> None:
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}]
    status, rendered = post(
        stack.http,
        "/tokenize",
        {"messages": history, "add_generation_prompt": False, "continue_final_message": True},
    )
    status_closed, closed = post(stack.http, "/tokenize", {"messages": history})
    assert status == status_closed == 200 and rendered["count"] < closed["count"]
    body = {"messages": history, "max_tokens": 2, "add_generation_prompt": False}
    status, reply = post(
        stack.http, "/v1/chat/completions", body | {"continue_final_message": True}
    )
    assert status == 200 and reply["usage"]["prompt_tokens"] == rendered["count"]
    status, err = post(
        stack.http, "/v1/chat/completions", body | {"chat_template_kwargs": {"tokenize": True}}
    )
    assert status == 400 and "tokenize" in err["error"]["message"]

"""The HTTP app's refusals that a healthy tiny stack cannot produce (admission refused: 429 with
Retry-After; engine down: 503; each kind of engine-ended request; an unexpected exception), seen
by the openai SDK or urllib through a real uvicorn server on loopback over an engine stand-in."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from typing import Any

import openai
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from frontend_svc.engine.engine_types import EngineInfo
from frontend_svc.errors import EngineUnavailable, Overloaded, engine_error
from frontend_svc.inputs.input_processor import InputProcessor
from frontend_svc.openai.app import build_app
from frontend_svc.openai.generation import ServingContext
from frontend_svc.openai.server import HttpServer
from frontend_svc.requests import CompletionDelta, EngineRequest
from splitserve_contracts.output_types import ErrorKind, FinishReason
from splitserve_contracts.sampling_rules import Limits
from splitserve_runtime.engine_option_rules import engine_options

INFO = EngineInfo(
    "m",
    2048,
    2048,
    64,
    "float32",
    True,
    "0",
    1.0,
    engine_options(max_num_seqs=8, max_num_batched_tokens=64),
)


class RefusingEngine:
    """Refuses every request with `error`; readiness as given."""

    def __init__(self, error: Exception, is_ready: bool) -> None:
        self.error, self.is_ready = error, is_ready

    async def generate(
        self, request: EngineRequest, arrival: float | None = None, coalesce: bool = True
    ) -> AsyncIterator[CompletionDelta]:
        raise self.error
        yield  # an async generator, like AsyncEngine.generate


@contextlib.contextmanager
def serving(engine: Any, tokenizer: Any) -> Iterator[str]:
    """The app over `engine`, on a real uvicorn server on loopback; yields its base URL."""
    inputs = InputProcessor(tokenizer, INFO.max_model_len, Limits(INFO.vocab_size))
    app = build_app(ServingContext(engine, inputs, INFO, "m", time.time()), CollectorRegistry())
    loop = asyncio.new_event_loop()
    http = HttpServer(app, "127.0.0.1", 0)
    threading.Thread(target=loop.run_forever, daemon=True).start()
    port = asyncio.run_coroutine_threadsafe(http.start(), loop).result(30)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(http.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)


@pytest.fixture(params=["overloaded", "down"])
def server(request: pytest.FixtureRequest, tokenizer: Any) -> Iterator[tuple[str, str]]:
    error: Exception = (
        Overloaded("the queue is full", retry_after_s=2.5)
        if request.param == "overloaded"
        else EngineUnavailable("the engine core is unreachable")
    )
    engine: Any = RefusingEngine(error, is_ready=request.param == "overloaded")
    with serving(engine, tokenizer) as base:
        yield request.param, base


def test_refusals_map_to_status_and_sdk_class(server: tuple[str, str]) -> None:
    kind, base = server
    sdk = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    expected = openai.RateLimitError if kind == "overloaded" else openai.InternalServerError
    for stream in (False, True):  # a stream is refused before its status line goes out
        with pytest.raises(expected) as err:
            sdk.completions.create(model="m", prompt="hi", max_tokens=2, stream=stream)
        assert err.value.status_code == (429 if kind == "overloaded" else 503)
        if kind == "overloaded":
            assert err.value.response.headers["retry-after"] == "3"
    with pytest.raises(openai.APIStatusError):
        sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=10) as reply:
            status = reply.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    assert status == (200 if kind == "overloaded" else 503)


def test_requests_are_counted_in_vllms_http_metrics(server: tuple[str, str]) -> None:
    """http_requests_total{handler,method,status} as vLLM exports it: status grouped (4xx, 5xx),
    probes and scrapes left out; on the app's own /metrics."""
    kind, base = server
    sdk = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    for _ in range(2):
        with pytest.raises(openai.APIStatusError):
            sdk.completions.create(model="m", prompt="hi", max_tokens=2)
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(f"{base}/v1/no-such-route", timeout=10)
    for path in ("/health", "/metrics"):  # /health is 503 when the engine is down: still a probe
        with contextlib.suppress(urllib.error.HTTPError):
            urllib.request.urlopen(f"{base}{path}", timeout=10).close()
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as reply:
        families = {f.name: f for f in text_string_to_metric_families(reply.read().decode())}
    counted = {
        (s.labels["handler"], s.labels["method"], s.labels["status"]): s.value
        for s in families["http_requests"].samples
        if s.name == "http_requests_total"
    }
    refused = "4xx" if kind == "overloaded" else "5xx"
    assert counted == {("/v1/completions", "POST", refused): 2, ("none", "GET", "4xx"): 1}
    assert "http_request_duration_seconds" in families


class EndingEngine:
    """Ends every request as the engine core does when it cannot serve it: one delta with
    FINISH_REASON_ERROR, of the given kind and with the engine's own text."""

    is_ready = True

    def __init__(self, kind: int, message: str) -> None:
        self.kind, self.message = kind, message

    async def generate(
        self, request: EngineRequest, arrival: float | None = None, coalesce: bool = True
    ) -> AsyncIterator[CompletionDelta]:
        yield CompletionDelta(
            0, [], "", 1, 0, 0, FinishReason.ERROR, None, None, self.message, self.kind
        )


def _post(base: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], Any]:
    data = json.dumps(body).encode()
    request = urllib.request.Request(f"{base}{path}", data=data, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read()), reply.headers
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), err.headers


ADDRESS_TEXT = "worker rank 0 (127.0.0.1:9402) is unreachable"


@pytest.mark.parametrize(
    "kind, message, status",
    [
        (ErrorKind.INVALID_REQUEST, "the request may need 3000 tokens of KV cache", 400),
        (ErrorKind.OVERLOADED, "the engine's queue is full; retry later", 429),
        (0, f"engine failed: {ADDRESS_TEXT}", 503),
    ],
)
def test_engine_ended_requests_map_by_kind_as_on_grpc(
    tokenizer: Any, kind: int, message: str, status: int
) -> None:
    """One mapping for both APIs (errors.engine_error): the request's own fault is a 400 with
    the engine's reason, a full queue a 429 with Retry-After, a failure a 503 with an error id
    and none of the engine's text (worker addresses stay in the log)."""
    expected = engine_error("r", kind, message)
    calls: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ]
    with serving(EndingEngine(kind, message), tokenizer) as base:
        for path, body in calls:
            code, reply, headers = _post(base, path, body)
            assert code == status == expected.http_status, reply
            text = reply["error"]["message"]
            if status == 400:
                assert text == str(expected) == f"refused by the engine: {message}"
            if status == 429:
                assert headers["Retry-After"] == "1" and text == message
            if status == 503:
                assert "error id" in text and "127.0.0.1" not in text and "rank" not in text


class BrokenEngine:
    """Fails with an exception no handler expects, carrying internal text."""

    is_ready = True

    async def generate(
        self, request: EngineRequest, arrival: float | None = None, coalesce: bool = True
    ) -> AsyncIterator[CompletionDelta]:
        raise RuntimeError("secret detail at 10.1.2.3")
        yield  # an async generator, like AsyncEngine.generate


def test_unexpected_errors_get_an_error_id_and_a_rate_limited_log(
    tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with serving(BrokenEngine(), tokenizer) as base, caplog.at_level(logging.ERROR):
        replies = [_post(base, "/v1/completions", {"prompt": "hi"}) for _ in range(30)]
    for code, reply, _ in replies:
        assert code == 500 and "error id" in reply["error"]["message"]
        assert "10.1.2.3" not in reply["error"]["message"]
    tracebacks = [r for r in caplog.records if r.exc_info is not None]
    assert len(tracebacks) == 1, f"{len(tracebacks)} tracebacks logged for 30 failures"
    first_id = replies[0][1]["error"]["message"].split("error id ")[1].rstrip(")")
    assert first_id in tracebacks[0].getMessage()

"""The HTTP app's refusals that a healthy tiny stack cannot produce (admission refused: 429 with
Retry-After; engine down: 503), seen by the openai SDK through a real uvicorn server on loopback
over an engine stand-in."""

from __future__ import annotations

import asyncio
import contextlib
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

from frontend_svc.engine_types import EngineInfo
from frontend_svc.errors import EngineUnavailable, Overloaded
from frontend_svc.input_processor import InputProcessor
from frontend_svc.openai.app import build_app
from frontend_svc.openai.generation import ServingContext
from frontend_svc.openai.server import HttpServer
from frontend_svc.requests import CompletionDelta, EngineRequest
from splitserve_contracts.sampling_rules import Limits

INFO = EngineInfo("m", "/m", 2048, 2048, 16, 64, 1, 1, "float32", 8, 64, True, "0", 1.0)


class RefusingEngine:
    """Refuses every request with `error`; readiness as given."""

    def __init__(self, error: Exception, is_ready: bool) -> None:
        self.error, self.is_ready = error, is_ready

    async def generate(
        self, request: EngineRequest, arrival: float | None = None, coalesce: bool = True
    ) -> AsyncIterator[CompletionDelta]:
        raise self.error
        yield  # an async generator, like AsyncEngine.generate


@pytest.fixture(params=["overloaded", "down"])
def server(request: pytest.FixtureRequest, tokenizer: Any) -> Iterator[tuple[str, str]]:
    error: Exception = (
        Overloaded("the queue is full", retry_after_s=2.5)
        if request.param == "overloaded"
        else EngineUnavailable("the engine core is unreachable")
    )
    engine: Any = RefusingEngine(error, is_ready=request.param == "overloaded")
    inputs = InputProcessor(tokenizer, INFO.max_model_len, Limits(INFO.vocab_size))
    app = build_app(ServingContext(engine, inputs, INFO, "m", time.time()), CollectorRegistry())
    loop = asyncio.new_event_loop()
    http = HttpServer(app, "127.0.0.1", 0)
    threading.Thread(target=loop.run_forever, daemon=True).start()
    port = asyncio.run_coroutine_threadsafe(http.start(), loop).result(30)
    yield request.param, f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(http.stop(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)


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

"""vLLM's operator routes and logs on the HTTP API, through a real uvicorn server on loopback
over an engine stand-in: --served-model-name aliases (/v1/models, requests), /load with
--enable-server-load-tracking, /tokenizer_info, /server_info (VLLM_SERVER_DEV_MODE), the
profiling routes, uvicorn's start-up line and access log (and --disable-uvicorn-access-log,
--disable-access-log-for-endpoints)."""

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

import pytest
from prometheus_client import CollectorRegistry

from frontend_svc.inputs.input_processor import InputProcessor
from frontend_svc.openai.app import build_app
from frontend_svc.openai.generation import ServingContext
from frontend_svc.openai.ops_routes import NO_OPS, OpsOptions
from frontend_svc.openai.server import HttpLog, HttpServer
from frontend_svc.requests import CompletionDelta, EngineRequest
from splitserve_contracts.output_types import FinishReason
from splitserve_contracts.sampling_rules import Limits
from tests.unit.frontend.test_openai_app import INFO

DEFAULT_LOG = HttpLog()


class SlowEngine:
    """Answers every request with one token after `delay` seconds."""

    is_ready = True

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay

    async def generate(
        self, request: EngineRequest, arrival: float | None = None, coalesce: bool = True
    ) -> AsyncIterator[CompletionDelta]:
        await asyncio.sleep(self.delay)
        yield CompletionDelta(0, [5], "x", 3, 1, 0, FinishReason.LENGTH)


class Profiler:
    def __init__(self) -> None:
        self.calls: list[tuple[int, str]] = []

    async def profile(self, action: int, prefix: str, timeout: float = 60.0) -> None:
        self.calls.append((action, prefix))


@contextlib.contextmanager
def serving(
    tokenizer: Any, ops: OpsOptions = NO_OPS, log: HttpLog = DEFAULT_LOG, delay: float = 0.0
) -> Iterator[str]:
    inputs = InputProcessor(tokenizer, INFO.max_model_len, Limits(INFO.vocab_size))
    ctx = ServingContext(SlowEngine(delay), inputs, INFO, "m", time.time(), model_aliases=("a",))  # type: ignore[arg-type]
    app = build_app(ctx, CollectorRegistry(), ops=ops)
    loop = asyncio.new_event_loop()
    http = HttpServer(app, "127.0.0.1", 0, log)
    threading.Thread(target=loop.run_forever, daemon=True).start()
    port = asyncio.run_coroutine_threadsafe(http.start(), loop).result(30)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(http.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)


def call(url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if data is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            text = reply.read()
            return reply.status, json.loads(text) if text else None
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


def test_every_served_model_name_is_accepted_and_listed(tokenizer: Any) -> None:
    with serving(tokenizer) as base:
        status, models = call(f"{base}/v1/models")
        assert status == 200 and [card["id"] for card in models["data"]] == ["m", "a"]
        for name in ("m", "a"):
            status, reply = call(f"{base}/v1/completions", {"model": name, "prompt": "hi"})
            assert status == 200 and reply["model"] == "m"  # vLLM answers with the first name
        assert call(f"{base}/v1/completions", {"model": "b", "prompt": "hi"})[0] == 404


def test_load_counts_requests_in_flight_when_tracking(tokenizer: Any) -> None:
    with serving(tokenizer, OpsOptions(track_load=True), delay=1.0) as base:
        assert call(f"{base}/load") == (200, {"server_load": 0})
        threads = [
            threading.Thread(target=call, args=(f"{base}/v1/completions", {"prompt": "hi"}))
            for _ in range(3)
        ]
        for thread in threads:
            thread.start()
        time.sleep(0.5)
        assert call(f"{base}/load") == (200, {"server_load": 3})
        for thread in threads:
            thread.join()
        assert call(f"{base}/load") == (200, {"server_load": 0})
    with serving(tokenizer) as base:  # not tracking: vLLM says 0
        assert call(f"{base}/load") == (200, {"server_load": 0})


def test_tokenizer_info_server_info_and_profiling_only_when_enabled(tokenizer: Any) -> None:
    with serving(tokenizer) as base:
        for path in ("/tokenizer_info", "/server_info"):
            assert call(f"{base}{path}")[0] == 404
        assert call(f"{base}/start_profile", {})[0] == 404
    profiler = Profiler()
    ops = OpsOptions(tokenizer_info=True, server_info={"port": 1}, profiler=profiler)
    with serving(tokenizer, ops) as base:
        status, info = call(f"{base}/tokenizer_info")
        assert status == 200 and info["tokenizer_class"] == type(tokenizer).__name__
        assert "vocab_file" not in info
        status, info = call(f"{base}/server_info?config_format=json")
        assert status == 200 and info["splitserve_config"]["frontend"] == {"port": 1}
        engine = info["splitserve_config"]["engine"]
        assert engine["max_model_len"] == INFO.max_model_len
        assert engine["options"]["scheduler"]["max_num_seqs"] == INFO.options.scheduler.max_num_seqs
        assert "model" not in engine["options"]["model"]
        assert call(f"{base}/start_profile", {"profile_prefix": "run1"}) == (200, None)
        assert call(f"{base}/stop_profile", {}) == (200, None)
        assert call(f"{base}/start_profile", {"max_iterations": 3})[0] == 400
        assert profiler.calls == [(1, "run1"), (2, "")]


def test_uvicorn_startup_and_access_log_lines(
    tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    with serving(tokenizer, log=HttpLog(quiet_paths=("/health",))) as base:
        call(f"{base}/v1/models")
        call(f"{base}/health")
    messages = [r.getMessage() for r in caplog.records]
    assert "Application startup complete." in messages
    access = [r.getMessage() for r in caplog.records if r.name == "uvicorn.access"]
    assert any('"GET /v1/models HTTP/1.1" 200' in m for m in access), access
    assert not any("/health" in m for m in access)
    caplog.clear()
    with serving(tokenizer, log=HttpLog(access_log=False)) as base:
        call(f"{base}/v1/models")
    assert not [r for r in caplog.records if r.name == "uvicorn.access"]

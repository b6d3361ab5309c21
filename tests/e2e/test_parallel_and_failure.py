"""A TP=2 stack, and a worker rank or an engine core that dies while serving (fail-stop)."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc
from tests.e2e.client import generate, join, text_request
from tests.e2e.stack import Stack
from tests.e2e.test_generate import PROMPT, hf_greedy
from tests.reliability.http_probes import assert_openai_error, post_json

pytestmark = pytest.mark.slow


def test_tp2_stack_matches_transformers(
    tiny_model_dir: Path, hf_model: Any, tokenizer: Any
) -> None:
    stack = Stack(tiny_model_dir, tp=2).start()
    try:
        assert len(list(stack.workers())) == 2
        result = generate(
            stack.frontend, text_request(PROMPT, temperature=0.0, max_tokens=24, ignore_eos=True)
        )[0]
        assert result.token_ids == hf_greedy(hf_model, tokenizer.encode(PROMPT), 24)
    finally:
        stack.stop()


def _readiness(addr: str, service: str) -> int:
    with grpc.insecure_channel(addr) as channel:
        return int(
            health_pb2_grpc.HealthStub(channel)
            .Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            .status
        )


def _http_in_flight(stack: Stack, stream: int, replies: list[tuple[int, Any]]) -> threading.Thread:
    body = {"prompt": PROMPT, "max_tokens": 1900, "ignore_eos": True, "stream": bool(stream)}

    def call() -> None:
        replies.append(post_json(stack.http, "/v1/completions", body, timeout=120))

    thread = threading.Thread(target=call)
    thread.start()
    return thread


def _assert_http_failures_carry_an_error_id(replies: list[tuple[int, Any]]) -> None:
    """Over HTTP too (issue 22 row 4): a 503 with an error id (a stream: an in-stream error
    event), never the engine's text ("worker rank 0 (127.0.0.1:...) is unreachable"). The
    stream's status line goes out with its first token: a stream that had none yet when the rank
    died gets the 503 itself."""
    assert len(replies) == 2 and {status for status, _ in replies} <= {200, 503}, replies
    assert 503 in {status for status, _ in replies}, replies  # the non-streamed call
    for status, reply in replies:
        if status == 200:  # the stream: its status line went out before the failure
            events = [e.removeprefix("data: ") for e in reply.split("\n\n") if e]
            reply = next(json.loads(e) for e in events if e.startswith('{"error"'))
        message = assert_openai_error(reply, 503)["message"]
        assert "error id" in message, message
        assert "rank" not in message and "127.0.0.1" not in message, message


def test_fail_stop_a_dead_worker_fails_requests_at_once_and_readiness_drops(
    tiny_model_dir: Path,
) -> None:
    """With --max-recovery-seconds 0 (fail-stop; tests/e2e/test_recovery.py has the default)."""
    stack = Stack(tiny_model_dir, max_recovery_seconds=0).start()
    try:
        errors: list[grpc.RpcError] = []
        started = threading.Event()

        def stream() -> None:
            request = text_request(PROMPT, max_tokens=1900, ignore_eos=True)
            with grpc.insecure_channel(stack.frontend) as channel:
                call = gen_grpc.GenerationServiceStub(channel).Generate(request, timeout=120)
                try:
                    for _ in call:
                        started.set()
                except grpc.RpcError as err:
                    errors.append(err)

        thread = threading.Thread(target=stream)
        thread.start()
        http_replies: list[tuple[int, Any]] = []
        http_threads = [_http_in_flight(stack, is_stream, http_replies) for is_stream in (0, 1)]
        assert started.wait(60)
        deadline = time.monotonic() + 60
        while stack.scheduler_stats().num_running_reqs < 3:
            assert time.monotonic() < deadline, "the HTTP requests never ran"
            time.sleep(0.05)
        killed_at = time.monotonic()
        next(stack.workers()).process.send_signal(signal.SIGKILL)
        for waited in [thread, *http_threads]:
            waited.join(60)
            assert not waited.is_alive()
        assert time.monotonic() - killed_at < 30
        assert errors and errors[0].code() == grpc.StatusCode.UNAVAILABLE
        details = errors[0].details() or ""
        assert "error id" in details  # the detail (worker rank, address) is in the log only
        assert "rank" not in details and "127.0.0.1" not in details
        _assert_http_failures_carry_an_error_id(http_replies)
        # A failed core exits non-zero, so its pod (or `splitserve up`) restarts it, and its
        # frontend stops reporting ready.
        assert stack.child("core").process.wait(timeout=30) != 0
        frontend_service = "splitserve.frontend.v1.GenerationService"
        deadline = time.monotonic() + 30
        while _readiness(stack.frontend, frontend_service) != (
            health_pb2.HealthCheckResponse.NOT_SERVING
        ):
            assert time.monotonic() < deadline, "frontend readiness never dropped"
            time.sleep(0.2)
        with pytest.raises(grpc.RpcError) as later:
            join(
                gen_grpc.GenerationServiceStub(grpc.insecure_channel(stack.frontend)).Generate(
                    text_request(PROMPT, max_tokens=2), timeout=30
                )
            )
        assert later.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        stack.stop()


def test_frontend_readiness_follows_the_core(tiny_model_dir: Path) -> None:
    stack = Stack(tiny_model_dir).start()
    try:
        frontend_service = "splitserve.frontend.v1.GenerationService"
        assert (
            _readiness(stack.frontend, frontend_service) == health_pb2.HealthCheckResponse.SERVING
        )
        stack.child("core").process.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _readiness(stack.frontend, frontend_service) != (
            health_pb2.HealthCheckResponse.NOT_SERVING
        ):
            assert time.monotonic() < deadline, "frontend readiness never dropped"
            time.sleep(0.2)
        with pytest.raises(grpc.RpcError) as err:
            generate(stack.frontend, text_request(PROMPT, max_tokens=2), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert _readiness(stack.frontend, "") == health_pb2.HealthCheckResponse.SERVING  # alive
    finally:
        stack.stop()

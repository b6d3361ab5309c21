"""Health tells the truth and SIGTERM drains, over real processes on loopback."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc
from splitserve_runtime.services import FRONTEND
from tests.e2e.client import Completion, generate, join, text_request
from tests.e2e.stack import Stack

PROMPT = "The quick brown fox"
pytestmark = pytest.mark.slow


def readiness(addr: str, service: str) -> int:
    with grpc.insecure_channel(addr) as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return int(health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status)


def stream_in_thread(
    addr: str, max_tokens: int, timed: bool = False
) -> tuple[threading.Thread, threading.Event, list]:
    """Start a greedy request that ignores EOS; returns (thread, first-token event, results).
    `timed`: the result is (the Completion or RpcError, when it ended, tokens received)."""
    started, results = threading.Event(), []

    def run() -> None:
        request = text_request(PROMPT, max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        with grpc.insecure_channel(addr) as channel:
            call = gen_grpc.GenerationServiceStub(channel).Generate(request, timeout=120)
            try:
                completion = Completion()
                for response in call:
                    started.set()
                    completion.token_ids += list(response.token_ids)
                    completion.finish_reason = response.finish_reason or completion.finish_reason
                outcome: Completion | grpc.RpcError = completion
            except grpc.RpcError as err:
                outcome = err
            ended = time.monotonic()
            results.append((outcome, ended, len(completion.token_ids)) if timed else outcome)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, started, results


def http_stream_in_thread(
    base: str, max_tokens: int
) -> tuple[threading.Thread, threading.Event, list]:
    """A streamed /v1/completions read to its end; the result is (its last event, when the
    stream ended, the number of events)."""
    started, results = threading.Event(), []

    def run() -> None:
        url = urlparse(base)
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=120)
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        events = []
        for line in conn.getresponse():
            if line.startswith(b"data: {"):
                events.append(json.loads(line[6:]))
                started.set()
        results.append((events[-1], time.monotonic(), len(events)))
        conn.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, started, results


def test_fail_stop_a_stopped_worker_is_noticed_within_its_step_timeout(
    tiny_model_dir: Path,
) -> None:
    """With --max-recovery-seconds 0 (fail-stop); test_recovery.py resumes instead."""
    stack = Stack(
        tiny_model_dir, core_flags=["--step-timeout-floor", "2"], max_recovery_seconds=0
    ).start()
    worker = next(stack.workers()).process
    try:
        thread, started, results = stream_in_thread(stack.frontend, 1900)
        assert started.wait(60)
        stopped_at = time.monotonic()
        os.kill(worker.pid, signal.SIGSTOP)
        thread.join(60)
        noticed = time.monotonic() - stopped_at
        assert isinstance(results[0], grpc.RpcError)
        assert results[0].code() == grpc.StatusCode.UNAVAILABLE
        assert "error id" in (results[0].details() or "")  # "hung or stopped": in the log
        assert noticed < 30, f"a SIGSTOPped worker took {noticed:.0f} s to notice"
        assert stack.child("core").process.wait(timeout=30) != 0
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        stack.stop()


def test_sigterm_drains_the_frontend(tiny_model_dir: Path) -> None:
    stack = Stack(tiny_model_dir).start()
    frontend = stack.child("frontend").process
    try:
        thread, started, results = stream_in_thread(stack.frontend, 200)
        assert started.wait(60)
        frontend.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert readiness(stack.frontend, FRONTEND.grpc_service) == (
            health_pb2.HealthCheckResponse.NOT_SERVING
        )
        with pytest.raises(grpc.RpcError) as refused:
            generate(stack.frontend, text_request(PROMPT, max_tokens=2), timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in (refused.value.details() or "")
        thread.join(60)
        (completion,) = results
        assert isinstance(completion, Completion), completion
        assert len(completion.token_ids) == 200  # the in-flight request finished
        assert frontend.wait(timeout=30) == 0
    finally:
        stack.stop()


def test_the_frontends_shutdown_timeout_aborts_what_still_runs(tiny_model_dir: Path) -> None:
    """--shutdown-timeout 1.5 with streams far longer (1900 tokens each, gRPC and HTTP): at
    the timeout they end (gRPC UNAVAILABLE, HTTP an error event), not when they are done, and
    the frontend exits soon after; the core frees their KV blocks."""
    timeout = 1.5
    stack = Stack(tiny_model_dir, frontend_flags=["--shutdown-timeout", str(timeout)]).start()
    frontend = stack.child("frontend").process
    try:
        streams = [stream_in_thread(stack.frontend, 1900, timed=True) for _ in range(2)]
        http_thread, http_started, http_result = http_stream_in_thread(stack.http, 1900)
        assert all(started.wait(60) for _, started, _ in streams) and http_started.wait(60)
        signalled = time.monotonic()
        frontend.send_signal(signal.SIGTERM)
        for thread, _, _ in streams:
            thread.join(60)
        http_thread.join(60)
        for _, _, ((err, ended, num_tokens),) in streams:
            assert isinstance(err, grpc.RpcError), f"finished with {num_tokens} tokens"
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
            assert "shutdown-timeout" in (err.details() or "")
            assert timeout - 0.2 < ended - signalled < timeout + 2.5, ended - signalled
        (last_event, ended, num_chunks) = http_result[0]
        assert "shutdown-timeout" in last_event["error"]["message"], last_event
        assert timeout - 0.2 < ended - signalled < timeout + 2.5, ended - signalled
        assert num_chunks < 1900
        assert frontend.wait(timeout=timeout + 10) == 0
        assert time.monotonic() - signalled < timeout + 5
        deadline = time.monotonic() + 10
        while (stats := stack.scheduler_stats()).num_running_reqs and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (stats.num_running_reqs, stats.kv_cache_usage) == (0, 0.0)
    finally:
        stack.stop()


def test_sigterm_drains_the_core(tiny_model_dir: Path) -> None:
    stack = Stack(tiny_model_dir).start()
    core = stack.child("core").process
    try:
        thread, started, results = stream_in_thread(stack.frontend, 200)
        assert started.wait(60)
        core.send_signal(signal.SIGTERM)
        thread.join(60)
        (completion,) = results
        assert isinstance(completion, Completion), completion
        assert len(completion.token_ids) == 200
        assert core.wait(timeout=30) == 0
        with pytest.raises(grpc.RpcError) as later:
            join(
                gen_grpc.GenerationServiceStub(grpc.insecure_channel(stack.frontend)).Generate(
                    text_request(PROMPT, max_tokens=2), timeout=30
                )
            )
        assert later.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        stack.stop()


def test_sigterm_to_every_process_at_once_still_drains(tiny_model_dir: Path) -> None:
    """What `helm uninstall` does (every pod gets SIGTERM together): the worker keeps running
    the core's open step stream (--shutdown-timeout), so the core's and the frontend's drains
    finish the in-flight request; the worker then exits as soon as the core closed the stream."""
    stack = Stack(tiny_model_dir).start()
    processes = [c.process for c in stack.children]
    try:
        thread, started, results = stream_in_thread(stack.frontend, 200)
        assert started.wait(60)
        for process in reversed(processes):  # workers first: the harshest order
            process.send_signal(signal.SIGTERM)
        thread.join(60)
        (completion,) = results
        assert isinstance(completion, Completion), completion
        assert len(completion.token_ids) == 200
        assert [p.wait(timeout=60) for p in processes] == [0] * len(processes)
    finally:
        stack.stop()

"""A request the engine core ends (FINISH_REASON_ERROR) reaches both public APIs through one
mapping (frontend_svc/errors.py engine_error): its own bad data is a 400 / INVALID_ARGUMENT with
the same message on both, a full queue a 429 with Retry-After / RESOURCE_EXHAUSTED with
RetryInfo, never a 503 "retry it" carrying the engine's text (issue 22 row 4). The rank-failure
case (503 with an error id, no address) is in tests/e2e/test_parallel_and_failure.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc
from tests.e2e.client import text_request
from tests.e2e.stack import Stack
from tests.reliability.http_probes import assert_openai_error, http_call, post_json
from tests.reliability.probes import (
    PYTHON_INTERNALS,
    assert_serving_and_idle,
    call_error,
    rich_status,
)

pytestmark = pytest.mark.slow
INTERNAL = (*PYTHON_INTERNALS, "rank", "127.0.0.1", "worker")
LOGPROBS_PAST_THE_VOCABULARY = 3000
"""Allowed by this stack's frontend (--max-logprobs 4096), refused by the worker ranks (at most
the vocabulary, 2048): a request whose own data only the engine refuses."""


@pytest.fixture(scope="module")
def engine_stack(tiny_model_dir: Path) -> Iterator[Stack]:
    """One request runs at a time and one may wait; the frontend lets logprobs past the
    vocabulary through, for the engine to refuse."""
    stack = Stack(
        tiny_model_dir,
        core_flags=["--max-num-seqs", "1", "--max-num-queued-reqs", "1"],
        frontend_flags=["--max-logprobs", "4096"],
    )
    stack.start()
    yield stack
    stack.stop()


def _grpc_refusal(stack: Stack, request: Any) -> Any:
    with grpc.insecure_channel(stack.frontend) as channel:
        stub = gen_grpc.GenerationServiceStub(channel)
        err = call_error(lambda: stub.Generate(request, timeout=60))
    assert err is not None, "the engine served it"
    return rich_status(err)


def test_a_request_the_engine_refuses_is_the_same_400_on_both_apis(engine_stack: Stack) -> None:
    logprobs = LOGPROBS_PAST_THE_VOCABULARY
    expected = f"refused by the engine: logprobs must be in [0, 2048], got {logprobs}"
    chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}
    for path, body in [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": logprobs}),
        ("/v1/completions", {"prompt": "hi", "logprobs": logprobs, "stream": True}),
        ("/v1/chat/completions", {**chat, "top_logprobs": logprobs}),
        ("/v1/chat/completions", {**chat, "top_logprobs": logprobs, "stream": True}),
    ]:
        status, reply = post_json(engine_stack.http, path, body)
        assert status == 400, reply
        error = assert_openai_error(reply, 400)
        assert error["type"] == "invalid_request_error" and error["message"] == expected, error
        assert not [f for f in INTERNAL if f in error["message"]], error
    grpc_status = _grpc_refusal(engine_stack, text_request("hi", max_tokens=2, logprobs=logprobs))
    assert grpc_status.code == grpc.StatusCode.INVALID_ARGUMENT, grpc_status
    assert grpc_status.reason == "INVALID_REQUEST"
    assert grpc_status.message == expected  # the same public message on both APIs
    assert_serving_and_idle(engine_stack)


class Stream:
    """A gRPC stream of 1500 tokens, read on its own thread."""

    def __init__(self, channel: grpc.Channel) -> None:
        request = text_request("long story", max_tokens=1500, ignore_eos=True)
        self.call = gen_grpc.GenerationServiceStub(channel).Generate(request, timeout=300)
        self.started = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for _ in self.call:
                self.started.set()
        except grpc.RpcError:
            pass


def _wait_for(condition: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_full_core_queue_is_a_429_with_retry_after_over_http(engine_stack: Stack) -> None:
    stack = engine_stack
    with grpc.insecure_channel(stack.frontend) as channel:
        running = Stream(channel)
        waiting = None
        try:
            assert running.started.wait(60), "the running request produced no token"
            waiting = Stream(channel)
            _wait_for(lambda: stack.scheduler_stats().num_waiting_reqs == 1, "none queued")
            body = b'{"prompt": "one more", "max_tokens": 4}'
            status, reply, response = http_call(stack.http, "POST", "/v1/completions", body)
            error = assert_openai_error(reply, status)
            assert status == 429 and error["type"] == "rate_limit_error", reply
            assert int(response.headers["Retry-After"]) >= 1
            assert "--max-num-queued-reqs 1" in error["message"]
            grpc_status = _grpc_refusal(stack, text_request("one more", max_tokens=4))
            assert grpc_status.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert grpc_status.reason == "OVERLOADED" and grpc_status.retry_delay_s
            assert grpc_status.message == error["message"]
            stats = stack.scheduler_stats()
            assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 1), "one ended early"
        finally:
            for stream in (running, waiting):
                if stream is not None:
                    stream.call.cancel()
    assert_serving_and_idle(stack)

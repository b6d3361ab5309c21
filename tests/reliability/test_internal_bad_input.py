"""The internal services under bad or hostile messages (tests/reliability/internal_cases.py),
over real processes on loopback: each call gets its status (a bad request on EngineStream ends
alone, with FINISH_REASON_ERROR, while the request beside it is served), and after every case
the engine still serves and nothing leaked."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.core.v1 import core_service_pb2 as core_pb2
from splitserve_contracts.core.v1 import core_service_pb2_grpc as core_grpc
from tests.e2e.stack import Stack
from tests.reliability.internal_cases import (
    ADD_CASES,
    RPC_CASES,
    AddCase,
    RpcCase,
    core_request,
)
from tests.reliability.probes import assert_proper_status, assert_serving_and_idle, call_error

pytestmark = pytest.mark.slow
ERROR, LENGTH = types_pb2.FINISH_REASON_ERROR, types_pb2.FINISH_REASON_LENGTH
INVALID_REQUEST = core_pb2.ERROR_KIND_INVALID_REQUEST
VALID_HANDLE, BAD_HANDLE = 1, 2


def test_the_table_has_the_cases_the_issue_asks_for() -> None:
    assert len(RPC_CASES) + len(ADD_CASES) >= 20
    methods = {c.method.rsplit("/", 1)[1] for c in RPC_CASES}
    assert methods >= {"Handshake", "EngineStream", "GetSchedulerStats", "Describe", "LoadModel"}
    assert "ResetPrefixCache" in methods
    assert methods >= {"GetKvCapacity", "InitializeKvCache", "Execute"}


def _address(stack: Stack, method: str) -> str:
    return stack.core if "EngineCoreService" in method else stack.worker


@pytest.mark.parametrize("case", RPC_CASES, ids=lambda c: c.id)
def test_internal_calls_get_their_status_and_the_engine_keeps_serving(
    shared_stack: Stack, case: RpcCase
) -> None:
    payload = case.request if isinstance(case.request, bytes) else case.request.SerializeToString()
    with grpc.insecure_channel(_address(shared_stack, case.method)) as channel:
        if case.kind == "stream":
            call = channel.stream_stream(case.method)
            err = call_error(lambda: call(iter([payload]), timeout=60, metadata=case.metadata))
        else:
            unary = channel.unary_unary(case.method)
            err = call_error(lambda: unary(payload, timeout=60, metadata=case.metadata))
    if case.code is None:
        assert err is None, err
    else:
        assert err is not None, f"{case.id} succeeded"
        assert err.code() == case.code, err.details()
        assert case.fragment in (err.details() or ""), err.details()
        assert_proper_status(err)
    assert_serving_and_idle(shared_stack)


def run_stream(
    core: str, messages: list[core_pb2.EngineStreamRequest], num_finishes: int
) -> list[core_pb2.EngineCoreOutput]:
    """Send `messages` on one EngineStream, keep it open until `num_finishes` requests have
    finished, then close it; the finishing outputs, in order."""
    outbox: queue.Queue[core_pb2.EngineStreamRequest | None] = queue.Queue()
    for message in messages:
        outbox.put(message)

    def requests() -> Iterator[core_pb2.EngineStreamRequest]:
        while (message := outbox.get()) is not None:
            yield message

    finished: list[core_pb2.EngineCoreOutput] = []
    with grpc.insecure_channel(core) as channel:
        call: Any = core_grpc.EngineCoreServiceStub(channel).EngineStream(requests(), timeout=60)
        try:
            for response in call:
                finished += [d for d in response.outputs.details if d.finish_reason]
                if len(finished) >= num_finishes:
                    break
        finally:
            outbox.put(None)
            call.cancel()
    return finished


def _add(*requests: core_pb2.EngineCoreRequest) -> core_pb2.EngineStreamRequest:
    return core_pb2.EngineStreamRequest(add=core_pb2.AddRequests(requests=requests))


@pytest.mark.parametrize("case", ADD_CASES, ids=lambda c: c.id)
def test_a_bad_request_on_the_core_stream_fails_alone(shared_stack: Stack, case: AddCase) -> None:
    bad = core_request(BAD_HANDLE, case)
    valid = core_request(VALID_HANDLE)
    outputs = run_stream(shared_stack.core, [_add(valid, bad)], 2)
    finished = {d.request_handle: d for d in outputs}
    assert finished[VALID_HANDLE].finish_reason == LENGTH, finished[VALID_HANDLE]
    outcome = finished[bad.request_handle]
    if case.fragment:
        assert (outcome.finish_reason, outcome.error_kind) == (ERROR, INVALID_REQUEST), outcome
        assert case.fragment in outcome.error_message
    else:
        assert outcome.finish_reason == LENGTH, outcome
    assert_serving_and_idle(shared_stack)


def test_aborts_of_unknown_handles_empty_messages_and_pings_are_harmless(
    shared_stack: Stack,
) -> None:
    messages = [
        core_pb2.EngineStreamRequest(),
        core_pb2.EngineStreamRequest(abort=core_pb2.AbortRequests(request_handles=[7, 2**64 - 1])),
        core_pb2.EngineStreamRequest(ping=core_pb2.Ping(ping_id=2**64 - 1)),
        _add(core_request(VALID_HANDLE)),
    ]
    (finished,) = run_stream(shared_stack.core, messages, 1)
    assert (finished.request_handle, finished.finish_reason) == (VALID_HANDLE, LENGTH)
    assert_serving_and_idle(shared_stack)


def test_a_handle_used_twice_refuses_the_second_only(shared_stack: Stack) -> None:
    first, second = core_request(VALID_HANDLE), core_request(VALID_HANDLE)
    first.max_tokens = 40
    refused, served = run_stream(shared_stack.core, [_add(first, second)], 2)
    assert refused.finish_reason == ERROR and "already in use" in refused.error_message
    assert served.finish_reason == LENGTH
    assert_serving_and_idle(shared_stack)

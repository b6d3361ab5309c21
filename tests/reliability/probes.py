"""What every reliability case checks once it has run: the reply was a proper status (a gRPC code
a client can act on, a message without Python internals, google.rpc details), the stack still
serves a normal request, and nothing leaked (the core's running, waiting and KV usage back to 0
within IDLE_WITHIN_S)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from splitserve_contracts.core.v1 import core_service_pb2 as core_pb2
from tests.e2e.client import generate, text_request
from tests.e2e.stack import Stack

IDLE_WITHIN_S = 2.0
PYTHON_INTERNALS = ("Traceback", "<class", 'File "', "Exception", "Error:", "object at 0x")
"""Fragments that only a leaked Python exception puts in a client-visible message."""


def wait_idle(stack: Stack, within: float = IDLE_WITHIN_S) -> core_pb2.SchedulerStats:
    """The core's stats once nothing runs, waits or holds KV blocks; fails after `within` s."""
    deadline = time.monotonic() + within
    while True:
        stats = stack.scheduler_stats()
        idle = stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
        if idle and stats.kv_cache_usage == 0.0:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"the engine is not idle {within:.0f} s after the case: {stats}")
        time.sleep(0.05)


def assert_serving_and_idle(stack: Stack) -> None:
    """A normal request still completes, then the engine drains to idle."""
    done = generate(stack.frontend, text_request("still serving", max_tokens=2), timeout=60)
    assert done[0].finish_reason, "the canary request did not finish"
    wait_idle(stack)


@dataclass
class RichStatus:
    """A failed call's code, message and google.rpc details."""

    code: grpc.StatusCode
    message: str
    reason: str = ""
    """ErrorInfo.reason, when the server sent one."""
    fields: list[str] = field(default_factory=list)
    """BadRequest field violations."""
    retry_delay_s: float | None = None
    """RetryInfo.retry_delay, when the server sent one."""


def rich_status(err: grpc.RpcError) -> RichStatus:
    call: Any = err
    status = RichStatus(call.code(), call.details() or "")
    decoded = rpc_status.from_call(call)
    for detail in decoded.details if decoded is not None else []:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            status.reason = info.reason
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            status.fields += [v.field for v in bad.field_violations]
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            status.retry_delay_s = retry.retry_delay.ToMilliseconds() / 1000
    return status


def assert_proper_status(err: grpc.RpcError) -> None:
    """Never UNKNOWN, never a Python exception's text."""
    call: Any = err
    code, message = call.code(), call.details() or ""
    assert code != grpc.StatusCode.UNKNOWN, message
    leaked = [f for f in PYTHON_INTERNALS if f in message]
    assert not leaked, f"{code.name}: {message!r} shows {leaked}"


def call_error(thunk: Any) -> grpc.RpcError | None:
    """Run a call (a thunk; a streaming reply is read to its end); its RpcError, or None."""
    try:
        reply = thunk()
        if hasattr(reply, "__iter__") and not isinstance(reply, bytes | str):
            for _ in reply:
                pass
    except grpc.RpcError as err:
        return err
    return None

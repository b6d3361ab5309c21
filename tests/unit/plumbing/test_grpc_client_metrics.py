"""The standard gRPC client metrics on the services' channels (splitserve_runtime.channels with
GrpcClientMetrics), against a real gRPC server process on loopback: each call counted once when
it starts and once when it ends with its status, a long stream never per message."""

from __future__ import annotations

import asyncio
import queue
import signal
import subprocess
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from prometheus_client import CollectorRegistry

from splitserve_runtime.channels import ChannelSecurity, open_aio_channel, open_channel
from splitserve_runtime.grpc_client_metrics import GrpcClientMetrics
from tests.fixtures.echo_grpc_server import SERVICE, start_echo_server

PLAINTEXT = ChannelSecurity(None, "test")


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    process, addr = start_echo_server()
    yield addr
    process.kill()  # the server this module started, by its Popen
    process.wait(10)


def _value(registry: CollectorRegistry, name: str, kind: str, method: str, **labels: str) -> float:
    base = {"grpc_type": kind, "grpc_service": SERVICE, "grpc_method": method}
    return registry.get_sample_value(name, {**base, **labels}) or 0.0


async def _until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not counted in time"
        await asyncio.sleep(0.01)


def _sync_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not counted in time"
        time.sleep(0.01)


def test_unary_calls_are_counted_with_their_codes(server: str) -> None:
    registry = CollectorRegistry()

    async def calls() -> None:
        async with open_aio_channel(server, PLAINTEXT, metrics=GrpcClientMetrics(registry)) as ch:
            unary = ch.unary_unary(f"/{SERVICE}/Unary")
            assert await unary(b"hello", timeout=10) == b"hello"
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await unary(b"fail", timeout=10)
            assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            handled = "grpc_client_handled_total"
            await _until(lambda: _value(registry, handled, "unary", "Unary", grpc_code="OK") == 1)
            await _until(
                lambda: (
                    _value(registry, handled, "unary", "Unary", grpc_code="INVALID_ARGUMENT") == 1
                )
            )

    asyncio.run(calls())
    assert _value(registry, "grpc_client_started_total", "unary", "Unary") == 2
    assert _value(registry, "grpc_client_handling_seconds_count", "unary", "Unary") == 2


def test_a_cancelled_server_stream_is_counted_cancelled(server: str) -> None:
    registry = CollectorRegistry()

    async def cancel() -> None:
        async with open_aio_channel(server, PLAINTEXT, metrics=GrpcClientMetrics(registry)) as ch:
            call = ch.unary_stream(f"/{SERVICE}/Repeat")(b"tick", timeout=30)
            for _ in range(5):
                assert await call.read() == b"tick"
            call.cancel()
            await _until(
                lambda: (
                    _value(
                        registry,
                        "grpc_client_handled_total",
                        "server_stream",
                        "Repeat",
                        grpc_code="CANCELLED",
                    )
                    == 1
                )
            )

    asyncio.run(cancel())
    assert _value(registry, "grpc_client_started_total", "server_stream", "Repeat") == 1
    assert (
        _value(registry, "grpc_client_handled_total", "server_stream", "Repeat", grpc_code="OK")
        == 0
    )


def _kill(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGKILL)  # the server this test started, by PID
    process.wait(10)


def test_a_bidi_stream_is_counted_once_and_ends_unavailable_when_its_server_dies() -> None:
    """As the frontend's EngineStream: written with call.write(), 50 messages each way, counted
    started once and not handled until it ends, then UNAVAILABLE when the core dies."""
    registry = CollectorRegistry()
    process, addr = start_echo_server()

    async def stream() -> None:
        async with open_aio_channel(addr, PLAINTEXT, metrics=GrpcClientMetrics(registry)) as ch:
            call = ch.stream_stream(f"/{SERVICE}/Echo")()
            for i in range(50):
                await call.write(b"%d" % i)
                assert await call.read() == b"%d" % i
            assert _value(registry, "grpc_client_started_total", "bidi_stream", "Echo") == 1
            assert (
                _value(registry, "grpc_client_handling_seconds_count", "bidi_stream", "Echo") == 0
            )
            _kill(process)
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await call.read()
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
            await _until(
                lambda: (
                    _value(registry, "grpc_client_handling_seconds_count", "bidi_stream", "Echo")
                    == 1
                )
            )

    try:
        asyncio.run(stream())
    finally:
        process.kill()
        process.wait(10)
    handled = "grpc_client_handled_total"
    assert _value(registry, handled, "bidi_stream", "Echo", grpc_code="UNAVAILABLE") == 1
    assert _value(registry, "grpc_client_started_total", "bidi_stream", "Echo") == 1


def test_a_sync_bidi_stream_whose_server_dies_is_counted_unavailable() -> None:
    """As the core's Execute stream to a worker rank (a sync channel fed by a queue)."""
    registry = CollectorRegistry()
    process, addr = start_echo_server()
    try:
        with open_channel(addr, PLAINTEXT, GrpcClientMetrics(registry)) as channel:
            outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
            replies = channel.stream_stream(f"/{SERVICE}/Echo")(iter(outbox.get, None))
            for i in range(50):
                outbox.put(b"%d" % i)
                assert next(replies) == b"%d" % i
            assert _value(registry, "grpc_client_started_total", "bidi_stream", "Echo") == 1
            assert (
                _value(registry, "grpc_client_handling_seconds_count", "bidi_stream", "Echo") == 0
            )
            _kill(process)
            with pytest.raises(grpc.RpcError) as ended:
                next(replies)
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
            outbox.put(None)
    finally:
        process.kill()
        process.wait(10)
    handled = "grpc_client_handled_total"
    _sync_until(
        lambda: _value(registry, handled, "bidi_stream", "Echo", grpc_code="UNAVAILABLE") == 1
    )
    assert _value(registry, "grpc_client_started_total", "bidi_stream", "Echo") == 1

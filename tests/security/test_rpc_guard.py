"""The interceptors every server runs (splitserve_runtime.rpc_guard), on real gRPC servers on
loopback: malformed protobuf gets INVALID_ARGUMENT with one log line per method per interval,
an unexpected servicer error reaches the client as an error id only, role admission, the
internal secret."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from splitserve_runtime.channels import ChannelSecurity
from splitserve_runtime.listener import internal_listener
from splitserve_runtime.log_limits import RepeatFilter
from splitserve_runtime.rpc_guard import AioRpcGuard, GuardPolicy, SyncRpcGuard, role_admission

SERVICE = "test.v1.Probe"
SECRET = "/opt/models/private at 10.1.2.3"
MALFORMED = b"\x0a\x05ab"
Request = health_pb2.HealthCheckRequest
Reply = health_pb2.HealthCheckResponse


async def _fail(request: Any, context: Any) -> Any:
    raise RuntimeError(SECRET)


async def _fail_streaming(request: Any, context: Any) -> AsyncIterator[Any]:
    yield Reply(status=Reply.SERVING)
    raise RuntimeError(SECRET)


async def _echo(request: Any, context: Any) -> Any:
    return Reply(status=Reply.SERVING)


def _handlers(kind: str = "aio") -> grpc.GenericRpcHandler:
    serialize, parse = Reply.SerializeToString, Request.FromString
    if kind == "sync":
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "SyncEcho": grpc.unary_unary_rpc_method_handler(
                    lambda r, c: Reply(status=Reply.SERVING), parse, serialize
                )
            },
        )
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Fail": grpc.unary_unary_rpc_method_handler(_fail, parse, serialize),
            "FailStreaming": grpc.unary_stream_rpc_method_handler(
                _fail_streaming, parse, serialize
            ),
            "Echo": grpc.unary_unary_rpc_method_handler(_echo, parse, serialize),
        },
    )


async def _call_aio(method: str, payload: bytes, stream: bool = False) -> grpc.aio.AioRpcError:
    server = grpc.aio.server(interceptors=[AioRpcGuard(GuardPolicy(shield_errors=True))])
    server.add_generic_rpc_handlers([_handlers()])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            try:
                if stream:
                    async for _ in ch.unary_stream(f"/{SERVICE}/{method}")(payload, timeout=10):
                        pass
                else:
                    await ch.unary_unary(f"/{SERVICE}/{method}")(payload, timeout=10)
            except grpc.aio.AioRpcError as err:
                return err
            raise AssertionError("the call succeeded")
    finally:
        await server.stop(None)


@pytest.mark.parametrize(("method", "stream"), [("Fail", False), ("FailStreaming", True)])
def test_unexpected_errors_reach_clients_as_an_error_id(
    method: str, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    err = asyncio.run(_call_aio(method, Request().SerializeToString(), stream))
    details = err.details() or ""
    assert err.code() == grpc.StatusCode.INTERNAL
    assert "error id" in details and SECRET not in details and "RuntimeError" not in details
    error_id = details.split("error id ")[1].rstrip(")")
    logged = [r for r in caplog.records if error_id in r.getMessage()]
    assert logged and SECRET in str(logged[0].exc_info[1])  # type: ignore[index]


def test_malformed_messages_are_refused_and_logged_once_per_method(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)

    async def flood() -> list[grpc.aio.AioRpcError]:
        return [await _call_aio("Echo", MALFORMED) for _ in range(20)]

    errors = asyncio.run(flood())
    assert {e.code() for e in errors} == {grpc.StatusCode.INVALID_ARGUMENT}
    assert "grpc.health.v1.HealthCheckRequest" in (errors[0].details() or "")
    malformed = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert len(malformed) == 1
    assert not [r for r in caplog.records if r.name.startswith("grpc")]  # no tracebacks


def test_sync_servers_refuse_malformed_messages_and_unadmitted_roles(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    policy = GuardPolicy(admissions={SERVICE: role_admission(frozenset({"splitserve-core"}))})
    open_server = grpc.server(ThreadPoolExecutor(2), interceptors=[SyncRpcGuard(GuardPolicy())])
    guarded = grpc.server(ThreadPoolExecutor(2), interceptors=[SyncRpcGuard(policy)])
    ports = []
    for server in (open_server, guarded):
        server.add_generic_rpc_handlers([_handlers("sync")])
        ports.append(server.add_insecure_port("127.0.0.1:0"))
        server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{ports[0]}") as ch:
            call = ch.unary_unary(f"/{SERVICE}/SyncEcho")
            assert call(Request().SerializeToString(), timeout=10) == b"\x08\x01"
            with pytest.raises(grpc.RpcError) as malformed:
                call(MALFORMED, timeout=10)
        assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert not [r for r in caplog.records if r.name.startswith("grpc")]
        with (
            grpc.insecure_channel(f"127.0.0.1:{ports[1]}") as ch,
            pytest.raises(grpc.RpcError) as denied,
        ):
            ch.unary_unary(f"/{SERVICE}/SyncEcho")(Request().SerializeToString(), timeout=10)
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED  # plaintext: no role
        assert "no identity" in (denied.value.details() or "")
    finally:
        open_server.stop(None)
        guarded.stop(None)


INTERNAL_SECRET = "0123456789abcdef-internal"


def _secret_guard() -> GuardPolicy:
    """What a plaintext core or worker with --internal-secret guards its service with."""
    listener = internal_listener(
        tls=None,
        allowed_roles={SERVICE: frozenset({"splitserve-core"})},
        enable_reflection=False,
        health_port=None,
        secret=INTERNAL_SECRET,
    )
    assert listener.credentials is None
    return listener.guard


def _presenting(secret: str) -> tuple[tuple[str, str], ...]:
    return ChannelSecurity(None, "splitserve-worker", secret).call_metadata()


def test_plaintext_ports_with_a_secret_admit_only_calls_that_present_it() -> None:
    """Sync (worker) and grpc.aio (core) servers alike: no secret, a wrong one, one a character
    short: UNAUTHENTICATED, never naming either value; the right one passes."""
    wrong = ("", "wrong-secret-value-1", INTERNAL_SECRET[:-1], INTERNAL_SECRET + "x")
    request = Request().SerializeToString()

    def check(call: Any) -> None:
        for secret in wrong:
            with pytest.raises(grpc.RpcError) as refused:
                call(request, timeout=10, metadata=_presenting(secret))
            details = refused.value.details() or ""
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, secret
            assert "internal secret" in details and INTERNAL_SECRET[:8] not in details
            assert not secret or secret[:8] not in details
        assert call(request, timeout=10, metadata=_presenting(INTERNAL_SECRET)) == b"\x08\x01"

    sync_server = grpc.server(ThreadPoolExecutor(2), interceptors=[SyncRpcGuard(_secret_guard())])
    sync_server.add_generic_rpc_handlers([_handlers("sync")])
    port = sync_server.add_insecure_port("127.0.0.1:0")
    sync_server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            check(ch.unary_unary(f"/{SERVICE}/SyncEcho"))
    finally:
        sync_server.stop(None)

    async def aio() -> None:
        server = grpc.aio.server(interceptors=[AioRpcGuard(_secret_guard())])
        server.add_generic_rpc_handlers([_handlers()])
        aio_port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            with grpc.insecure_channel(f"127.0.0.1:{aio_port}") as ch:
                await asyncio.to_thread(check, ch.unary_unary(f"/{SERVICE}/Echo"))
        finally:
            await server.stop(None)

    asyncio.run(aio())


def test_repeated_log_lines_are_limited_per_message() -> None:
    limit = RepeatFilter(interval_s=0.2)

    def record(method: str) -> logging.LogRecord:
        message = f"Unexpected [DecodeError] raised by servicer method [{method}]"
        return logging.LogRecord("grpc._cython.cygrpc", logging.ERROR, "", 0, message, None, None)

    kept = [limit.filter(record("/a/B")) for _ in range(50)]
    assert kept.count(True) == 1
    assert limit.filter(record("/a/C"))  # another method has its own budget
    time.sleep(0.25)
    later = record("/a/B")
    assert limit.filter(later) and "49 more like it" in later.getMessage()

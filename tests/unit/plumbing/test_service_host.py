"""The grpc.aio service host: its interceptors pass every handler shape through, including the
health service's Watch, which streams through context.write() rather than yielding."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve_runtime.service_host import ServiceHost

SERVICE = "splitserve.core.v1.EngineCoreService"


async def _watch_two_states() -> list[int]:
    host = ServiceHost(name="core", host="127.0.0.1", port=0, service_names=[SERVICE])
    await host.start()
    try:
        async with grpc.aio.insecure_channel(host.address) as channel:
            call = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=SERVICE), timeout=10
            )
            first = await call.read()
            await host.set_ready(True)
            second = await call.read()
            call.cancel()
        return [first.status, second.status]
    finally:
        await host.server.stop(None)


def test_health_watch_streams_readiness_changes() -> None:
    statuses = asyncio.run(_watch_two_states())
    assert statuses == [
        health_pb2.HealthCheckResponse.NOT_SERVING,
        health_pb2.HealthCheckResponse.SERVING,
    ]

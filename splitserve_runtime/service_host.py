"""Start-up plumbing shared by the three services: one grpc.aio server with the standard health
service, server reflection, a Prometheus `/metrics` endpoint and a graceful SIGTERM.

Health semantics (Kubernetes gRPC probes understand both):
- liveness is the empty service name "": SERVING while the process runs, NOT_SERVING once it shuts
  down or has failed;
- readiness is per named service (e.g. "splitserve.core.v1.EngineCoreService"): NOT_SERVING until
  the service says it is ready, and again whenever it cannot serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from wsgiref.simple_server import WSGIServer

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
)

from splitserve_runtime.grpc_metrics import GrpcServerMetrics
from splitserve_runtime.listener import Listener, bind, start_aio_health_server
from splitserve_runtime.log_limits import limit_grpc_logs
from splitserve_runtime.metrics_http import start_metrics_server
from splitserve_runtime.rpc_guard import AioRpcGuard
from splitserve_runtime.termination import report_fatal

logger = logging.getLogger(__name__)

LIVENESS = ""
ShutdownHook = Callable[[], Awaitable[None]]


def new_registry() -> CollectorRegistry:
    """A registry of this service's own (tests run several services in one process), with the
    standard process, platform and GC collectors."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


class ServiceHost:
    """Runs one service's grpc.aio server until SIGTERM/SIGINT or a fatal error."""

    def __init__(
        self,
        *,
        name: str,
        host: str,
        port: int,
        service_names: Sequence[str],
        metrics_port: int | None = None,
        grace_seconds: float = 10.0,
        listener: Listener | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.name = name
        self.listener = listener or Listener()
        self.host = host
        self.port = port
        self.service_names = list(service_names)
        self.metrics_port = metrics_port
        self.registry = registry or new_registry()
        """The service's metrics (`registry`, when its clients count into it before the host
        is built)."""
        self.grace_seconds = grace_seconds
        limit_grpc_logs()
        self.server = grpc.aio.server(
            options=self.listener.options,
            interceptors=[
                GrpcServerMetrics(self.registry),
                *self.listener.interceptors,
                AioRpcGuard(self.listener.guard),
            ],
        )
        self.health = health.aio.HealthServicer()
        self.bound_port = 0
        self.metrics_bound_port: int | None = None
        self.exit_code = 0
        self._stop = asyncio.Event()
        self._metrics_server: WSGIServer | None = None
        self._health_server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.bound_port}"

    async def start(self) -> int:
        """Bind and start; liveness SERVING, readiness NOT_SERVING. Returns the bound port."""
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if self.listener.enable_reflection:
            names = [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
            reflection.enable_server_reflection(names, self.server)
        self.bound_port = bind(self.server, self.name, self.host, self.port, self.listener)
        if self.bound_port == 0:
            raise OSError(f"{self.name}: cannot bind {self.host}:{self.port}")
        await self.server.start()
        if self.listener.health_port is not None:
            self._health_server = await start_aio_health_server(
                self.health, self.host, self.listener.health_port
            )
        await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        for service in self.service_names:
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._start_metrics()
        logger.info("%s listening on %s", self.name, self.address)
        return self.bound_port

    def _start_metrics(self) -> None:
        if self.metrics_port is None:
            return
        server = start_metrics_server(self.registry, self.host, self.metrics_port)
        self._metrics_server = server
        self.metrics_bound_port = int(server.server_address[1])
        logger.info(
            "%s metrics on http://%s:%d/metrics", self.name, self.host, self.metrics_bound_port
        )

    async def set_ready(self, is_ready: bool, service: str | None = None) -> None:
        """Set readiness of one named service (default: all of them)."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if is_ready
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in [service] if service else self.service_names:
            await self.health.set(name, status)

    def request_stop(self, exit_code: int = 0) -> None:
        """Ask the host to shut down (call from the event loop thread)."""
        self.exit_code = max(self.exit_code, exit_code)
        self._stop.set()

    async def set_unhealthy(self, message: str) -> None:
        """The service can no longer serve but keeps running (so clients get clear errors):
        readiness and liveness turn NOT_SERVING, and an orchestrator restarts it."""
        logger.error("%s: %s", self.name, message)
        await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.set_ready(False)

    async def fail(self, message: str) -> None:
        """A fatal error: mark everything NOT_SERVING, report it, and stop with exit code 1."""
        report_fatal(self.name, message)
        await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.set_ready(False)
        self.request_stop(1)

    async def run_until_stopped(self, on_shutdown: ShutdownHook | None = None) -> int:
        """Serve until SIGTERM/SIGINT or `request_stop`; then stop gracefully. Returns the exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.request_stop)
        await self._stop.wait()
        await self.shutdown(on_shutdown)
        return self.exit_code

    async def shutdown(self, on_shutdown: ShutdownHook | None = None) -> None:
        """Stop accepting, let the service finish or abort in-flight work, close the server:
        all within `grace_seconds` (calls still open then are cancelled)."""
        logger.info("%s shutting down", self.name)
        deadline = asyncio.get_running_loop().time() + self.grace_seconds
        await self.health.enter_graceful_shutdown()
        if on_shutdown is not None:
            try:
                await asyncio.wait_for(on_shutdown(), timeout=self.grace_seconds)
            except Exception:
                logger.exception("%s: shutdown hook failed", self.name)
                self.exit_code = max(self.exit_code, 1)
        remaining = deadline - asyncio.get_running_loop().time()
        await self.server.stop(grace=max(0.5, remaining))
        if self._health_server is not None:
            await self._health_server.stop(grace=None)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        logger.info("%s stopped", self.name)

"""Start-up plumbing for a service on a synchronous gRPC server (the worker ranks).

Same contract as service_host.ServiceHost — health (liveness "" and readiness per named service),
reflection, `/metrics`, graceful SIGTERM — for a server whose handlers run on threads of their own
(ThreadPerRpcExecutor). The worker needs that: its Execute stream runs each step on the
stream's own thread, with no hand-off between the network and the model.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from types import FrameType
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from splitserve_runtime.grpc_metrics import SyncGrpcServerMetrics
from splitserve_runtime.listener import Listener, bind, start_sync_health_server
from splitserve_runtime.log_limits import limit_grpc_logs
from splitserve_runtime.metrics_http import start_metrics_server
from splitserve_runtime.rpc_guard import SyncRpcGuard
from splitserve_runtime.service_host import LIVENESS, new_registry

logger = logging.getLogger(__name__)
T = TypeVar("T")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ThreadPerRpcExecutor(Executor):
    """Runs every submitted call on a new thread that ends with it, so no thread outlives the
    RPC it served (and no torch thread pool outlives the thread that made it)."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:
                future.set_exception(exc)

        threading.Thread(target=run, daemon=True, name="rpc").start()
        return future


class SyncServiceHost:
    """Runs one service's synchronous gRPC server until SIGTERM/SIGINT."""

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
    ) -> None:
        self.name, self.host, self.port = name, host, port
        self.listener = listener or Listener()
        self.service_names = list(service_names)
        self.metrics_port = metrics_port
        self.grace_seconds = grace_seconds
        self.registry = new_registry()
        limit_grpc_logs()
        self.server = grpc.server(
            ThreadPerRpcExecutor(),
            options=self.listener.options,
            interceptors=[
                SyncGrpcServerMetrics(self.registry),
                *self.listener.interceptors,
                SyncRpcGuard(self.listener.guard),
            ],
        )
        self.health = health.HealthServicer()
        self.bound_port = 0
        self._stop = threading.Event()
        self._health_server: grpc.Server | None = None

    def start(self) -> int:
        """Bind and start; liveness SERVING, readiness NOT_SERVING. Returns the bound port."""
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if self.listener.enable_reflection:
            names = [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
            reflection.enable_server_reflection(names, self.server)
        self.bound_port = bind(self.server, self.name, self.host, self.port, self.listener)
        if self.bound_port == 0:
            raise OSError(f"{self.name}: cannot bind {self.host}:{self.port}")
        self.server.start()
        if self.listener.health_port is not None:
            self._health_server = start_sync_health_server(
                self.health, self.host, self.listener.health_port
            )
        self.health.set(LIVENESS, SERVING)
        self.set_ready(False)
        if self.metrics_port is not None:
            start_metrics_server(self.registry, self.host, self.metrics_port)
        logger.info("%s listening on %s:%d", self.name, self.host, self.bound_port)
        return self.bound_port

    def set_ready(self, is_ready: bool) -> None:
        for service in self.service_names:
            self.health.set(service, SERVING if is_ready else NOT_SERVING)

    def run_until_stopped(self, on_shutdown: Callable[[], None] | None = None) -> int:
        """Serve until SIGTERM/SIGINT (call from the main thread); stop gracefully; exit code."""

        def on_signal(signum: int, frame: FrameType | None) -> None:
            self._stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        while not self._stop.wait(0.5):
            pass
        logger.info("%s shutting down", self.name)
        self.health.enter_graceful_shutdown()
        self.server.stop(self.grace_seconds).wait()
        if self._health_server is not None:
            self._health_server.stop(None)
        code = 0
        if on_shutdown is not None:
            try:
                on_shutdown()
            except Exception:
                logger.exception("%s: shutdown hook failed", self.name)
                code = 1
        logger.info("%s stopped", self.name)
        return code

"""The HTTP server: uvicorn on the frontend's own asyncio loop, so HTTP and gRPC share one
AsyncEngine. The frontend's ServiceHost owns SIGTERM/SIGINT; uvicorn's own signal capture is
switched off. With `--ssl-certfile`/`--ssl-keyfile` (the same files as the gRPC port) it serves
HTTPS, and with `--ssl-ca-certs` it requires client certificates, as vLLM's server does. Idle,
header and body timeouts and a connection cap: http_limits.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Iterator

import uvicorn
from starlette.applications import Starlette

from frontend_svc.openai.http_limits import (
    HttpLimits,
    fitted_limits,
    protocol_class,
    raise_open_file_limit,
)
from splitserve_runtime.tls import TlsFiles

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """Serve `app` on host:port (0 picks a free port) until `stop`."""

    def __init__(
        self,
        app: Starlette,
        host: str,
        port: int,
        log_level: str = "warning",
        tls: TlsFiles | None = None,
        limits: HttpLimits | None = None,
    ) -> None:
        self.limits = fitted_limits(limits or HttpLimits(), raise_open_file_limit())
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            log_config=None,  # uvicorn's records go through the service's handler (text or JSON)
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
            http=protocol_class(self.limits),
            timeout_keep_alive=self.limits.timeout_keep_alive,  # type: ignore[arg-type]
            ssl_certfile=tls.cert_file if tls else None,
            ssl_keyfile=tls.key_file if tls else None,
            ssl_ca_certs=tls.ca_file if tls and tls.ca_file else None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls and tls.ca_file else ssl.CERT_NONE,
        )
        self._server = _Server(config)
        self._task: asyncio.Task[None] | None = None
        self.host = host
        self.port = port
        self.scheme = "https" if tls is not None else "http"

    async def start(self) -> int:
        """Bind and serve in a task; returns the bound port. Raises OSError if binding fails."""
        self._task = asyncio.create_task(self._server.serve(), name="http-server")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # uvicorn logged why; surface its error
                raise OSError(f"HTTP server could not bind {self.host}:{self.port}")
            await asyncio.sleep(0.01)
        sockets = self._server.servers[0].sockets
        self.port = int(sockets[0].getsockname()[1])
        logger.info(
            "OpenAI-compatible HTTP API on %s://%s:%d/v1", self.scheme, self.host, self.port
        )
        return self.port

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        await asyncio.wait([self._task], timeout=10.0)

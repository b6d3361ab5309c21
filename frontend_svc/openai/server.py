"""The HTTP server: uvicorn on the frontend's own asyncio loop, so HTTP and gRPC share one
AsyncEngine. The frontend's ServiceHost owns SIGTERM/SIGINT; uvicorn's own signal capture is
switched off. With `--ssl-certfile`/`--ssl-keyfile` (the same files as the gRPC port) it serves
HTTPS, and with `--ssl-ca-certs` it requires client certificates, as vLLM's server does. Idle,
header and body timeouts and a connection cap: http_limits.py.

uvicorn logs as under `vllm serve` (its records go through the service's handler, text or
JSON): the start-up lines ("Application startup complete.") at --uvicorn-log-level info, and an
access line per request (client, method, path, status) unless --disable-uvicorn-access-log;
--disable-access-log-for-endpoints leaves some paths out."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Iterator
from dataclasses import dataclass

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


@dataclass(frozen=True)
class HttpLog:
    """What uvicorn logs (vLLM's flags)."""

    level: str = "info"
    access_log: bool = True
    quiet_paths: tuple[str, ...] = ()
    """Paths left out of the access log."""


class _QuietPaths(logging.Filter):
    """Drops access-log records of the given paths (the query string does not count)."""

    def __init__(self, paths: tuple[str, ...]) -> None:
        super().__init__()
        self.paths = frozenset(paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3:
            return str(args[2]).split("?", 1)[0] not in self.paths
        return True


def _install_access_filter(log: HttpLog) -> None:
    access = logging.getLogger("uvicorn.access")
    for old in [f for f in access.filters if isinstance(f, _QuietPaths)]:
        access.removeFilter(old)
    if log.quiet_paths:
        access.addFilter(_QuietPaths(log.quiet_paths))


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
        log: HttpLog = HttpLog(),
        tls: TlsFiles | None = None,
        limits: HttpLimits | None = None,
    ) -> None:
        self.limits = fitted_limits(limits or HttpLimits(), raise_open_file_limit())
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log.level,
            log_config=None,  # uvicorn's records go through the service's handler (text or JSON)
            access_log=log.access_log,
            lifespan="on",  # its start-up lines, as under vLLM ("Application startup complete.")
            timeout_graceful_shutdown=5,
            http=protocol_class(self.limits),
            timeout_keep_alive=self.limits.timeout_keep_alive,  # type: ignore[arg-type]
            ssl_certfile=tls.cert_file if tls else None,
            ssl_keyfile=tls.key_file if tls else None,
            ssl_ca_certs=tls.ca_file if tls and tls.ca_file else None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls and tls.ca_file else ssl.CERT_NONE,
        )
        _install_access_filter(log)
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

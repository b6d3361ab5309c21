"""The `/metrics` HTTP endpoint of a service, always in Prometheus' classic text format.

vLLM's metric names contain colons (`vllm:num_requests_running`). prometheus_client >= 0.23
rewrites colons in sample names to underscores when a scraper negotiates OpenMetrics (as
Prometheus does by default), which would silently rename every vLLM series. Serving the classic
text format (0.0.4) keeps the names exactly as vLLM's dashboards and alerts expect them.

prometheus_client's app answers every path with the metrics page; here only `/metrics` does, and
any other path gets 404, so a mistyped scrape path or a probe fails loudly instead of scraping.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

CLASSIC_TEXT = "text/plain; version=0.0.4; charset=utf-8"
METRICS_PATHS = ("/metrics", "/metrics/")
Wsgi = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
        """Scrapes are not worth a log line each."""


def classic_text_app(registry: CollectorRegistry) -> Wsgi:
    """A WSGI app serving `registry` in the classic text format, whatever the Accept header."""
    app = make_wsgi_app(registry)

    def serve(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "") not in METRICS_PATHS:
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"Not Found: metrics are served on /metrics\n"]
        return app({**environ, "HTTP_ACCEPT": CLASSIC_TEXT}, start_response)

    return serve


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> WSGIServer:
    """Serve /metrics on host:port (0 picks a port) in a daemon thread; returns the server."""
    server = make_server(
        host, port, classic_text_app(registry), ThreadingWSGIServer, handler_class=_QuietHandler
    )
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server

"""The frontend's HTTP server flags: its timeouts and connection cap, its log and its small
routes (uvicorn's or vLLM's name where one has the setting)."""

from __future__ import annotations

import argparse

from frontend_svc.openai.http_limits import HttpLimits
from splitserve_runtime.flags import Flag, flag, positive_int

DEFAULT_HTTP_LIMITS = HttpLimits()


def positive_seconds(value: str) -> float:
    seconds = float(value)
    if not seconds > 0 or seconds == float("inf"):  # also NaN
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {value}")
    return seconds


HTTP_LIMIT_FLAGS: tuple[Flag, ...] = (
    flag(
        "--timeout-keep-alive",
        type=positive_seconds,
        default=DEFAULT_HTTP_LIMITS.timeout_keep_alive,
        help="close an HTTP connection idle this many seconds: a new one before its first "
        "byte, or one after its response (uvicorn's and vLLM's default)",
    ),
    flag(
        "--http-header-timeout",
        type=positive_seconds,
        default=DEFAULT_HTTP_LIMITS.header_timeout,
        help="seconds from a request's first byte to the end of its headers; then 408",
    ),
    flag(
        "--http-body-timeout",
        type=positive_seconds,
        default=DEFAULT_HTTP_LIMITS.body_timeout,
        help="seconds a request's whole body may take after its headers; then 408",
    ),
    flag(
        "--max-http-connections",
        type=positive_int,
        default=DEFAULT_HTTP_LIMITS.max_connections,
        help="HTTP connections open at once; more are refused with 503 (at most half the "
        "process's open file limit, so that gRPC and the engine keep theirs)",
    ),
)
"""The HTTP port's timeouts and connection cap (uvicorn's name where it has the setting)."""


def _paths(value: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in value.split(",") if p.strip())


HTTP_LOG_FLAGS: tuple[Flag, ...] = (
    flag(
        "--uvicorn-log-level",
        default=None,
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="level of the HTTP server's own log: its start-up lines and the access log at "
        "info (default: --log-level's, info unless set, as vLLM's)",
    ),
    flag(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="no access log line per HTTP request (client, method, path, status)",
    ),
    flag(
        "--disable-access-log-for-endpoints",
        type=_paths,
        default=(),
        help='comma-separated paths left out of the access log, e.g. "/health,/metrics"',
    ),
    flag(
        "--enable-server-load-tracking",
        action="store_true",
        help="/load counts the generation requests in flight on the HTTP API (else it says 0)",
    ),
    flag(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="serve /tokenizer_info: the tokenizer's configuration and chat template",
    ),
)
"""The HTTP server's log and its small routes (vLLM's names and defaults)."""

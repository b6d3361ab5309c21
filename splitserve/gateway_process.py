"""The Shepherd Model Gateway (`smg`, the optional extra `splitserve[gateway]`) in front of the
engines `splitserve serve --data-parallel-size N` starts: its command line, its process, its
readiness.

The gateway routes over each engine frontend's standard engine contract (smg-grpc-proto's
`VllmEngine`, `grpc://HOST:PORT`): it fetches the tokenizer with `GetTokenizer`, subscribes to the
engines' KV-cache events and serves the OpenAI API on its HTTP port. It runs as
`python -m splitserve.gateway_process SMG_FLAGS...`, which is smg's own router entry point
(`smg launch`, `python -m smg.launch_router`) with one difference: the client API key comes from
the environment (`SPLITSERVE_API_KEY`), never the command line, where `ps` would show it.

What smg does when an engine fails (measured in docs/deploy.md, "Data parallel"): an engine whose
core or rank is down answers new requests UNAVAILABLE at once and its health check not-ready, and
the gateway sends them to another engine; requests already running on it wait for the restarted
core and finish. smg's own defaults already drop a worker it has not heard from for 2 s
(`--worker-stall-secs`) and one that stops making progress (`--worker-wedge-secs`); the launcher
only makes its periodic health check frequent and its circuit breaker's open state short, so
that a recovered engine takes requests again within seconds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from splitserve.children import Child, connect_host
from splitserve_runtime.flags import env_name
from splitserve_runtime.termination import TERMINATION_MESSAGE_ENV

GATEWAY_EXTRA = "pip install 'splitserve[gateway]'"
ROUTER_POLICIES = (
    "cache_aware",
    "round_robin",
    "random",
    "power_of_two",
    "least_load",
    "prefix_hash",
    "consistent_hashing",
)
"""smg 1.13's `--policy` choices that balance one pool of engines (not `manual`, which needs
routing keys, nor `passthrough`, which is for a single worker)."""
NO_ROUTER = "none"
HEALTH_CHECK_INTERVAL_S = 2
"""smg's periodic health check of each engine (its default is 60 s)."""
CIRCUIT_OPEN_S = 5
"""How long smg's circuit breaker keeps an engine out after a run of failures before it tries
it again (its default is 60 s: a restarted engine would idle that long)."""
SMG_LOG_LEVELS = {"debug": "debug", "info": "warn", "warning": "warn", "error": "error"}
"""The launcher's --log-level -> smg's: smg logs every request at info, so it gets warn."""


def is_installed() -> bool:
    """True when the `smg` package (the gateway) can be imported."""
    return importlib.util.find_spec("smg") is not None


def missing_gateway_message(num_engines: int, router: str) -> str:
    return (
        f"--data-parallel-size {num_engines} with --router {router} puts the Shepherd Model "
        f"Gateway in front of the engines, and it is not installed: {GATEWAY_EXTRA} (or "
        f"--router {NO_ROUTER} for the engines alone)"
    )


def gateway_flags(
    host: str,
    port: int,
    metrics_port: int,
    engine_addrs: Sequence[str],
    policy: str,
    log_level: str,
    log_format: str,
    shutdown_timeout: float,
) -> list[str]:
    """smg's flags for a gateway on host:port routing to the engines' public gRPC ports."""
    flags = [
        *("--host", host, "--port", str(port)),
        *("--prometheus-host", connect_host(host), "--prometheus-port", str(metrics_port)),
        *("--worker-urls", *(grpc_url(a) for a in engine_addrs)),
        *("--policy", policy),
        *("--health-check-interval-secs", str(HEALTH_CHECK_INTERVAL_S)),
        *("--cb-timeout-duration-secs", str(CIRCUIT_OPEN_S)),
        *("--shutdown-grace-period-secs", str(max(1, round(shutdown_timeout)))),
        *("--log-level", SMG_LOG_LEVELS.get(log_level, "warn")),
    ]
    return [*flags, "--log-json"] if log_format == "json" else flags


def grpc_url(address: str) -> str:
    """An engine's public gRPC address as smg's worker URL (a wildcard host as loopback)."""
    host, port = address.rsplit(":", 1)
    return f"grpc://{connect_host(host)}:{port}"


def start_gateway(flags: Sequence[str], api_key: str = "") -> Child:
    """Start the gateway process (same environment as this one, plus the API key)."""
    command = [sys.executable, "-m", "splitserve.gateway_process", *flags]
    fd, message_path = tempfile.mkstemp(prefix="splitserve-gateway-", suffix=".termination")
    os.close(fd)
    env = {**os.environ, TERMINATION_MESSAGE_ENV: message_path}
    env.pop(env_name("api_key"), None)
    if api_key:
        env[env_name("api_key")] = api_key
    host, port = _flag(flags, "--host"), _flag(flags, "--port")
    address = f"{host}:{port}"
    metrics = f"http://{_flag(flags, '--prometheus-host')}:{_flag(flags, '--prometheus-port')}"
    process = subprocess.Popen(command, env=env)
    child = Child("gateway", "gateway", address, f"{metrics}/metrics", process, Path(message_path))
    child.http_address = address
    child.readiness_url = f"http://{connect_host(host)}:{port}/readiness"
    child.command, child.env = command, env
    return child


def _flag(flags: Sequence[str], name: str) -> str:
    return flags[list(flags).index(name) + 1]


def num_ready_engines(gateway: Child) -> int:
    """How many engines the gateway routes to now (0 while it is not ready)."""
    return ready_engines_at(gateway.readiness_url)


def ready_engines_at(readiness_url: str) -> int:
    """How many engines the gateway whose /readiness is `readiness_url` routes to now (0 while
    it is not ready or does not answer)."""
    try:
        with urllib.request.urlopen(readiness_url, timeout=2.0) as reply:
            return int(json.load(reply).get("healthy_workers", 0))
    except (OSError, ValueError, urllib.error.URLError):
        return 0


def main(argv: Sequence[str] | None = None) -> None:
    """smg's `launch` with the client API key from SPLITSERVE_API_KEY."""
    from smg.launch_router import launch_router, parse_router_args  # type: ignore[import-untyped]

    args = parse_router_args(list(sys.argv[1:] if argv is None else argv))
    args.api_key = os.environ.get(env_name("api_key")) or None
    launch_router(args)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Container health check of a splitserve service: one grpc.health.v1 Check, exit 0 if SERVING.

The image's HEALTHCHECK runs it with no arguments. It then finds out which service the
container runs from the main process's command line (/proc/1/cmdline: `splitserve frontend|core|
worker [--port N]`, `python -m frontend_svc|core_svc|worker_svc`, or `splitserve serve
[--grpc-port N]`, whose frontend it checks), falls back to the
SPLITSERVE_PORT environment variable and the service's default port, and checks that service's
readiness (the named health service). Kubernetes does not use this: the Helm chart declares
native gRPC probes instead.

    splitserve-healthcheck                       # readiness of the service in this container
    splitserve-healthcheck --liveness            # liveness (health service "")
    splitserve-healthcheck --addr 127.0.0.1:50061 --service splitserve.core.v1.EngineCoreService
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve_runtime.services import SERVICES  # the image's python (PATH) has splitserve

DEFAULT_PORTS = {kind: spec.default_port for kind, spec in SERVICES.items()}
READINESS = {kind: spec.grpc_service for kind, spec in SERVICES.items()}


def read_cmdline(pid: int = 1) -> list[str]:
    """The argv of process `pid` ([] when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


LAUNCHERS = ("serve", "up")
"""`splitserve serve|up` (the one-container image) runs the whole stack: its frontend answers."""


def role_of(argv: Sequence[str]) -> str | None:
    """frontend, core or worker, from a service's command line (the frontend for the
    launcher's)."""
    if _launcher(argv):
        return "frontend"
    for arg in argv:
        name = arg.removesuffix("_svc")
        if name in DEFAULT_PORTS:
            return name
    return None


def flag_of(argv: Sequence[str], environ: Mapping[str, str], name: str) -> int | None:
    """The integer value of --NAME on a command line, else of SPLITSERVE_NAME, else None."""
    for i, arg in enumerate(argv):
        if arg == f"--{name}" and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith(f"--{name}="):
            return int(arg.split("=", 1)[1])
    value = environ.get("SPLITSERVE_" + name.upper().replace("-", "_"), "")
    return int(value) if value.lstrip("-").isdigit() else None


def port_of(argv: Sequence[str], environ: Mapping[str, str], role: str | None) -> int:
    """The service's plaintext health port: --health-port when it has one (its main port then
    may be TLS), else --port on its command line, else SPLITSERVE_PORT, else the default."""
    health_port = flag_of(argv, environ, "health-port")
    if health_port is not None and health_port >= 0:
        return health_port
    launcher = _launcher(argv)
    if launcher:  # the frontend's public gRPC port; `serve --port` is the HTTP one, as in vLLM
        grpc_port = flag_of(argv, environ, "grpc-port")
        if grpc_port is None and launcher == "up":
            grpc_port = flag_of(argv, {}, "port")
        return DEFAULT_PORTS["frontend"] if grpc_port is None else grpc_port
    for i, arg in enumerate(argv):
        if arg == "--port" and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith("--port="):
            return int(arg.split("=", 1)[1])
    if environ.get("SPLITSERVE_PORT", "").isdigit():
        return int(environ["SPLITSERVE_PORT"])
    return DEFAULT_PORTS.get(role or "", DEFAULT_PORTS["frontend"])


def _launcher(argv: Sequence[str]) -> str:
    """`serve` or `up` when `argv` runs the launcher (`splitserve serve ...`), else ""."""
    for i, arg in enumerate(argv[:-1]):
        if arg.endswith("splitserve") and argv[i + 1] in LAUNCHERS:
            return argv[i + 1]
    return ""


def check(addr: str, service: str, timeout: float) -> bool:
    """True when the health service at `addr` answers SERVING for `service`."""
    try:
        with grpc.insecure_channel(addr) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
    except grpc.RpcError as err:
        print(f"{addr} {service or '(liveness)'}: {err.code().name}", file=sys.stderr)
        return False
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{addr} {service or '(liveness)'}: {status}")
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    env = os.environ if environ is None else environ
    p = argparse.ArgumentParser(prog="splitserve-healthcheck", description=__doc__.split("\n")[0])
    p.add_argument("--addr", default="", help="HOST:PORT to check (default: this container's)")
    p.add_argument("--service", default=None, help="health service name (default: readiness)")
    p.add_argument("--liveness", action="store_true", help='check the liveness service ""')
    p.add_argument("--timeout", type=float, default=3.0, help="seconds")
    args = p.parse_args(argv)
    cmdline = read_cmdline()
    role = role_of(cmdline)
    addr = args.addr or f"127.0.0.1:{port_of(cmdline, env, role)}"
    if args.liveness:
        service = ""
    elif args.service is not None:
        service = args.service
    else:
        service = READINESS.get(role or "", "")
    return 0 if check(addr, service, args.timeout) else 1


if __name__ == "__main__":
    sys.exit(main())

"""`splitserve up`: start worker ranks, engine core and frontend as child processes on loopback.

The internal hops (frontend -> core -> workers) use mutual TLS by default: the launcher makes a
throwaway CA and per-role certificates (splitserve/local_pki.py) in a private temporary folder
that it deletes on exit (`--no-internal-tls` for plaintext). The launcher waits until every
child reports SERVING on its readiness health check, prints one
`READY ...` line, optionally streams a sample answer, and keeps running. Ctrl-C or SIGTERM stops
every child; a child that dies takes the launcher down with a non-zero exit naming it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from frontend_svc.config import DEFAULT_HTTP_PORT
from splitserve.local_pki import LAUNCHER_IDENTITY, LocalPki
from splitserve_runtime.channels import ChannelSecurity, open_channel
from splitserve_runtime.flags import FlagParser, non_negative_int, positive_int
from splitserve_runtime.log_config import LOG_LEVELS
from splitserve_runtime.services import FRONTEND, SERVICES
from splitserve_runtime.tls import FRONTEND_ROLE, ROLE_OF_SERVICE, TlsFiles

LOOPBACK = "127.0.0.1"
STOP_GRACE_SECONDS = 15.0


@dataclass
class Child:
    """One service process started by the launcher."""

    name: str
    kind: str
    address: str
    metrics_url: str
    process: subprocess.Popen[bytes]
    probe: ChannelSecurity = field(default_factory=lambda: ChannelSecurity(None, FRONTEND_ROLE))
    """How the launcher reaches the child's health service."""
    http_address: str = ""
    """The frontend's OpenAI-compatible HTTP API (HOST:PORT); empty for the other services."""


class LaunchError(RuntimeError):
    """A child failed to start or died."""


def build_parser() -> FlagParser:
    p = FlagParser(
        prog="splitserve up",
        description="Start the whole stack on loopback. Any other `splitserve core` flag "
        "(e.g. --max-model-len, --max-num-seqs, --dtype) is passed to the engine core.",
    )
    p.add_argument("--model", default="", help="checkpoint folder (default: the embedded model)")
    p.add_argument("--tensor-parallel-size", "--tp", type=positive_int, default=1)
    p.add_argument("--pipeline-parallel-size", "--pp", type=positive_int, default=1)
    p.add_argument("--host", default=LOOPBACK, help="frontend listen address")
    p.add_argument(
        "--port",
        type=non_negative_int,
        default=FRONTEND.default_port,
        help="frontend port (0: any)",
    )
    p.add_argument(
        "--http-port",
        type=int,
        default=DEFAULT_HTTP_PORT,
        help="frontend's OpenAI-compatible HTTP port (0: any, -1: off)",
    )
    p.add_argument(
        "--api-key",
        default="",
        help="the frontend's API key (clients send `authorization: Bearer <key>`); also "
        "SPLITSERVE_API_KEY",
    )
    p.add_argument(
        "--sample-prompt",
        default="",
        help="after READY, stream one answer to this prompt to stdout",
    )
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for READY")
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on Ctrl-C or SIGTERM, seconds running requests may take to finish (the frontend "
        "and the core stop admitting) before they are aborted",
    )
    p.add_argument(
        "--internal-tls",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="mutual TLS between frontend, core and workers with a throwaway CA",
    )
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    return p


def free_ports(count: int) -> list[int]:
    """Ports free on loopback right now (all sockets held open together, so they differ)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind((LOOPBACK, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _spawn(
    name: str,
    kind: str,
    argv: list[str],
    address: str,
    metrics_port: int,
    pki: LocalPki | None = None,
    env: Mapping[str, str] | None = None,
) -> Child:
    """Start one service; `env` adds variables (secrets go there, not on the command line)."""
    cmd = [sys.executable, "-m", f"{kind}_svc", *argv, *_tls_flags(pki, kind)]
    process = subprocess.Popen(cmd, env={**os.environ, **env} if env else None)
    probe = ChannelSecurity(None, ROLE_OF_SERVICE[kind])
    if pki is not None and kind != FRONTEND.kind:  # the frontend's public port stays as asked
        probe = ChannelSecurity(pki.files[LAUNCHER_IDENTITY], ROLE_OF_SERVICE[kind])
    metrics_url = f"http://{LOOPBACK}:{metrics_port}/metrics"
    return Child(name, kind, address, metrics_url, process, probe)


def _tls_flags(pki: LocalPki | None, kind: str) -> list[str]:
    if pki is None:
        return []
    files: TlsFiles = pki.files[ROLE_OF_SERVICE[kind]]
    return [
        "--tls-cert-file",
        files.cert_file,
        "--tls-key-file",
        files.key_file,
        "--tls-ca-file",
        files.ca_file,
    ]


def start_children(
    args: argparse.Namespace,
    model: str,
    core_flags: list[str],
    pki: LocalPki | None = None,
) -> list[Child]:
    """Start workers, core and frontend; they find each other through the ports chosen here.
    With `pki`, every internal hop is mutual TLS with its certificates; without, plaintext."""
    engine = start_engine_children(args, model, core_flags, pki)
    try:
        return [*engine, start_frontend(args, model, engine[-1].address, pki)]
    except BaseException:
        stop_children(engine)
        raise


def start_engine_children(
    args: argparse.Namespace,
    model: str,
    core_flags: list[str],
    pki: LocalPki | None = None,
) -> list[Child]:
    """Start the worker ranks and the engine core (the core last); the offline `LLM` API for
    TP/PP > 1 runs its frontend in its own process on top of these."""
    world = args.tensor_parallel_size * args.pipeline_parallel_size
    ports = free_ports(2 * world + 3)
    common = ["--log-level", args.log_level]
    drain = ["--shutdown-timeout", str(getattr(args, "shutdown_timeout", 30.0))]
    workers = [
        _spawn(
            f"worker[{rank}]",
            "worker",
            [
                "--host",
                LOOPBACK,
                "--port",
                str(ports[rank]),
                "--metrics-port",
                str(ports[world + rank]),
                *common,
            ],
            f"{LOOPBACK}:{ports[rank]}",
            ports[world + rank],
            pki,
        )
        for rank in range(world)
    ]
    core_port, core_metrics, dist_port = ports[2 * world :]
    core_addr = f"{LOOPBACK}:{core_port}"
    core = _spawn(
        "core",
        "core",
        [
            "--model",
            model,
            "--host",
            LOOPBACK,
            "--port",
            str(core_port),
            "--metrics-port",
            str(core_metrics),
            "--worker-addrs",
            ",".join(w.address for w in workers),
            "--tensor-parallel-size",
            str(args.tensor_parallel_size),
            "--pipeline-parallel-size",
            str(args.pipeline_parallel_size),
            "--distributed-init-method",
            f"tcp://{LOOPBACK}:{dist_port}",
            *common,
            *drain,
            *core_flags,
        ],
        core_addr,
        core_metrics,
        pki,
    )
    return [*workers, core]


def start_frontend(
    args: argparse.Namespace, model: str, core_addr: str, pki: LocalPki | None = None
) -> Child:
    """Start a frontend on the engine core at `core_addr` (several may share one core)."""
    fe_metrics, fe_port, free_http_port = free_ports(3)
    port = args.port or fe_port
    http_port = args.http_port or free_http_port
    api_key = getattr(args, "api_key", "")
    frontend = _spawn(
        "frontend",
        "frontend",
        [
            "--model",
            model,
            "--core-addr",
            core_addr,
            "--host",
            args.host,
            "--port",
            str(port),
            "--metrics-port",
            str(fe_metrics),
            "--http-port",
            str(http_port),
            "--log-level",
            args.log_level,
            "--shutdown-timeout",
            str(getattr(args, "shutdown_timeout", 30.0)),
        ],
        f"{args.host}:{port}",
        fe_metrics,
        pki,
        {"SPLITSERVE_API_KEY": api_key} if api_key else None,  # not in argv, where ps shows it
    )
    if http_port >= 0:
        frontend.http_address = f"{args.host}:{http_port}"
    return frontend


def is_ready(child: Child) -> bool:
    """True when the child's readiness health check answers SERVING."""
    host, port = child.address.rsplit(":", 1)
    target = f"{LOOPBACK if host in ('0.0.0.0', '') else host}:{port}"
    try:
        with open_channel(target, child.probe) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(
                health_pb2.HealthCheckRequest(service=SERVICES[child.kind].grpc_service),
                timeout=1.0,
            )
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False


def check_alive(children: Sequence[Child]) -> None:
    for child in children:
        code = child.process.poll()
        if code is not None:
            raise LaunchError(f"{child.name} exited with code {code}")


def wait_ready(children: Sequence[Child], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = list(children)
    while pending:
        check_alive(children)
        pending = [c for c in pending if not is_ready(c)]
        if pending and time.monotonic() > deadline:
            names = ", ".join(c.name for c in pending)
            raise LaunchError(f"not ready after {timeout:.0f} s: {names}")
        if pending:
            time.sleep(0.25)


def stop_children(children: Sequence[Child], shutdown_timeout: float = 0.0) -> None:
    """Stop in stages, so a drain can finish: the frontends first (they stop admitting and let
    their requests finish, which needs the core and the workers), then the core, then the
    workers. Each stage gets SIGTERM and `shutdown_timeout` + STOP_GRACE_SECONDS before
    SIGKILL."""
    for kind in ("frontend", "core", "worker"):
        stage = [c for c in children if c.kind == kind and c.process.poll() is None]
        for child in stage:
            child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + shutdown_timeout + STOP_GRACE_SECONDS
        for child in stage:
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()


def ready_line(children: Sequence[Child]) -> str:
    by_kind = {kind: [c for c in children if c.kind == kind] for kind in SERVICES}
    return (
        f"READY frontend={by_kind['frontend'][0].address} core={by_kind['core'][0].address} "
        f"workers={','.join(c.address for c in by_kind['worker'])} "
        f"metrics={','.join(c.metrics_url for c in children)}"
        + "".join(f" http={c.http_address}" for c in by_kind["frontend"] if c.http_address)
    )


def stream_sample(address: str, prompt: str, api_key: str = "") -> None:
    from splitserve_client.generate import build_parser as generate_parser
    from splitserve_client.generate import build_request, print_stream, stream_text

    args = generate_parser().parse([prompt, "--max-tokens", "48"], {})
    print(f"sample prompt: {prompt}\nsample answer: ", end="", flush=True)
    print_stream(stream_text(address, build_request(args), 120.0, api_key), sys.stdout)


def _serve(children: list[Child], args: argparse.Namespace) -> int:
    wait_ready(children, args.startup_timeout)
    print(ready_line(children), flush=True)
    if args.sample_prompt:
        stream_sample(children[-1].address, args.sample_prompt, args.api_key)
    while True:
        check_alive(children)
        time.sleep(0.25)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    parser = build_parser()
    env = os.environ if environ is None else environ
    args, core_flags = parser.parse_known_env(argv, env)
    model = args.model
    if not model:
        from splitserve_runtime.default_model import ensure_default_model

        model = str(ensure_default_model(env))
    children: list[Child] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    pki_context = LocalPki() if args.internal_tls else contextlib.nullcontext(None)
    try:
        with pki_context as pki:
            try:
                children = start_children(args, model, core_flags, pki)
                return _serve(children, args)
            finally:
                stop_children(children, args.shutdown_timeout)  # before the certificates go
    except KeyboardInterrupt:
        print("splitserve up: stopping", file=sys.stderr)
        return 0
    except (LaunchError, grpc.RpcError) as err:
        message = err.details() if isinstance(err, grpc.RpcError) else str(err)
        print(f"splitserve up: {message}; stopping everything", file=sys.stderr)
        return 1

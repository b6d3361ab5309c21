"""The service processes of one stack on loopback: start them wired to each other, wait until
each reports SERVING, notice one dying (with its one-line termination reason), stop them
service by service. `splitserve up`, the offline `LLM` API for TP/PP > 1, the end-to-end tests and the
benchmarks all start their stacks here.

What to start is a StackOptions: what `splitserve up` parses, or what the offline `LLM` API,
the tests and the benchmarks ask for. With a LocalPki every internal hop is mutual TLS; without,
plaintext.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.local_pki import LAUNCHER_IDENTITY, LocalPki
from splitserve.loopback_ports import free_ports
from splitserve_runtime.channels import ChannelSecurity, open_channel
from splitserve_runtime.flags import env_name
from splitserve_runtime.services import FRONTEND, SERVICES
from splitserve_runtime.termination import TERMINATION_MESSAGE_ENV, read_termination_message
from splitserve_runtime.tls import FRONTEND_ROLE, ROLE_OF_SERVICE, TlsFiles
from worker_svc.cpu_binding import AUTO, OMP_THREADS_BIND_ENV

LOOPBACK = "127.0.0.1"
STOP_GRACE_SECONDS = 15.0


@dataclasses.dataclass(frozen=True)
class StackOptions:
    """How to start one stack's processes on loopback."""

    model: str
    revision: str = ""
    tokenizer: str = ""
    generation_config: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    host: str = LOOPBACK
    """The frontend's listen address (its HTTP, gRPC and metrics ports)."""
    grpc_port: int = 0
    """The frontend's public gRPC port (0: a free one)."""
    http_port: int = 0
    """The frontend's OpenAI HTTP port (0: a free one, -1: off)."""
    api_key: str = ""
    internal_secret: str = dataclasses.field(default="", repr=False)
    """The services' --internal-secret ("": none); passed in their environment."""
    log_level: str = "info"
    log_format: str = "text"
    shutdown_timeout: float = 30.0
    max_recovery_seconds: float | None = None
    """How long the core and the frontends wait for a lost rank or core (None: their default)."""
    service_flags: Mapping[str, Sequence[str]] = dataclasses.field(default_factory=dict)
    """Service kind -> the operator's own flags for every process of that service."""
    frontend_metrics_port: int = 0
    core_metrics_port: int = 0
    worker_metrics_port: int = 0
    """Each service's /metrics port (0: a free port each; -1: no metrics; a worker rank r
    adds r)."""
    worker_env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Environment added to every worker rank (e.g. the GPUs one engine of several gets)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> StackOptions:
        """What `splitserve up` parsed (its flags have these names; no flag sets worker_env)."""
        names = [f.name for f in dataclasses.fields(cls) if f.name != "worker_env"]
        return cls(**{name: getattr(args, name) for name in names})

    def metrics_port(self, kind: str, free_port: int, rank: int = 0) -> int:
        """The --metrics-port of a child of service `kind`: its setting (+ `rank` for workers)
        when positive, `free_port` when 0, -1 (none) when negative."""
        base = {
            "frontend": self.frontend_metrics_port,
            "core": self.core_metrics_port,
            "worker": self.worker_metrics_port,
        }[kind]
        if base > 0:
            return base + rank
        return free_port if base == 0 else -1


@dataclasses.dataclass
class Child:
    """One service process of the stack."""

    name: str
    kind: str
    address: str
    metrics_url: str
    process: subprocess.Popen[bytes]
    termination_message: Path
    """Where the child writes its one-line fatal reason."""
    probe: ChannelSecurity = dataclasses.field(
        default_factory=lambda: ChannelSecurity(None, FRONTEND_ROLE)
    )
    """How the launcher reaches the child's health service."""
    http_address: str = ""
    """The frontend's OpenAI-compatible HTTP API (HOST:PORT); empty for the other services."""
    command: list[str] = dataclasses.field(default_factory=list)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    """How it was started (splitserve/supervisor.py starts it again the same way)."""
    readiness_url: str = ""
    """Ready when a GET of this answers 200 (the gateway); "" for the services, whose
    readiness is their gRPC health check."""

    def exit_reason(self, code: int) -> str:
        reason = read_termination_message(self.termination_message)
        return f"{self.name} exited with code {code}" + (f": {reason}" if reason else "")


class LaunchError(RuntimeError):
    """A child failed to start or died."""


def _spawn(
    name: str,
    kind: str,
    argv: list[str],
    address: str,
    metrics_port: int,
    pki: LocalPki | None = None,
    env: Mapping[str, str] | None = None,
) -> Child:
    """Start one service; `env` adds variables (secrets go there, not on the command line:
    the API key, the internal secret)."""
    cmd = [sys.executable, "-m", f"{kind}_svc", *argv, *_tls_flags(pki, kind)]
    fd, message_path = tempfile.mkstemp(prefix=f"splitserve-{kind}-", suffix=".termination")
    os.close(fd)
    child_env = {**os.environ, **(env or {}), TERMINATION_MESSAGE_ENV: message_path}
    child_env.pop(env_name("config"), None)  # the launcher read the file and passes its flags on
    process = subprocess.Popen(cmd, env=child_env)
    probe = ChannelSecurity(None, ROLE_OF_SERVICE[kind])
    if pki is not None and kind != FRONTEND.kind:  # the frontend's public port stays as asked
        probe = ChannelSecurity(pki.files[LAUNCHER_IDENTITY], ROLE_OF_SERVICE[kind])
    metrics_url = ""
    if metrics_port >= 0:  # served on the child's listen address
        metrics_url = f"http://{connect_host(address.rsplit(':', 1)[0])}:{metrics_port}/metrics"
    child = Child(name, kind, address, metrics_url, process, Path(message_path), probe)
    child.command, child.env = cmd, child_env
    return child


def connect_host(listen_host: str) -> str:
    """Where a client on this machine reaches a service listening on `listen_host`."""
    return LOOPBACK if listen_host in ("", "0.0.0.0", "::", "[::]") else listen_host


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


def model_flags(options: StackOptions) -> tuple[list[str], list[str]]:
    """(core flags, frontend flags) naming the model as the operator did."""
    core = ["--model", options.model]
    if options.revision:
        core += ["--revision", options.revision]
    frontend = [*core, "--generation-config", options.generation_config]
    if options.tokenizer:
        frontend += ["--tokenizer", options.tokenizer]
    return core, frontend


def _common_flags(options: StackOptions, kind: str) -> list[str]:
    """Logging, drain and (core and frontend) recovery flags, then the operator's own flags
    for service `kind`."""
    flags = ["--log-level", options.log_level, "--log-format", options.log_format]
    flags += ["--shutdown-timeout", str(options.shutdown_timeout)]
    if kind != "worker" and options.max_recovery_seconds is not None:
        flags += ["--max-recovery-seconds", str(options.max_recovery_seconds)]
    return [*flags, *options.service_flags.get(kind, ())]


def start_children(options: StackOptions, pki: LocalPki | None = None) -> list[Child]:
    """Start workers, core and frontend; they find each other through the ports chosen here."""
    engine = start_engine_children(options, pki)
    try:
        return [*engine, start_frontend(options, engine[-1].address, pki)]
    except BaseException:
        stop_children(engine)
        raise


def _secret_env(options: StackOptions) -> dict[str, str]:
    """The stack's internal secret (--internal-secret), for every service's environment."""
    secret = options.internal_secret
    return {env_name("internal_secret"): secret} if secret else {}


def _start_worker(
    options: StackOptions, rank: int, port: int, free_metrics_port: int, pki: LocalPki | None
) -> Child:
    metrics = options.metrics_port("worker", free_metrics_port, rank)
    argv = ["--host", LOOPBACK, "--port", str(port), "--metrics-port", str(metrics)]
    argv += _common_flags(options, "worker")
    address = f"{LOOPBACK}:{port}"
    env = {**_worker_binding(options), **_secret_env(options)}
    return _spawn(f"worker[{rank}]", "worker", argv, address, metrics, pki, env)


def _worker_binding(options: StackOptions) -> dict[str, str]:
    """The ranks' environment: `worker_env`, and VLLM_CPU_OMP_THREADS_BIND=auto unless the
    operator's environment or `worker_env` says otherwise (every rank of this stack runs on
    this machine, beside its core and frontend: worker_svc/cpu_binding.py)."""
    env = dict(options.worker_env)
    if OMP_THREADS_BIND_ENV not in os.environ:
        env.setdefault(OMP_THREADS_BIND_ENV, AUTO)
    return env


def start_engine_children(options: StackOptions, pki: LocalPki | None = None) -> list[Child]:
    """Start the worker ranks and the engine core (the core last); the offline `LLM` API for
    TP/PP > 1 runs its frontend in its own process on top of these."""
    world = options.tensor_parallel_size * options.pipeline_parallel_size
    ports = free_ports(2 * world + 3)
    workers = [_start_worker(options, r, ports[r], ports[world + r], pki) for r in range(world)]
    core_port, free_core_metrics, dist_port = ports[2 * world :]
    core_metrics = options.metrics_port("core", free_core_metrics)
    argv = [
        *model_flags(options)[0],
        *("--host", LOOPBACK, "--port", str(core_port), "--metrics-port", str(core_metrics)),
        *("--worker-addrs", ",".join(w.address for w in workers)),
        *("--tensor-parallel-size", str(options.tensor_parallel_size)),
        *("--pipeline-parallel-size", str(options.pipeline_parallel_size)),
        *("--distributed-init-method", f"tcp://{LOOPBACK}:{dist_port}"),
        *_common_flags(options, "core"),
    ]
    core_addr = f"{LOOPBACK}:{core_port}"
    core = _spawn("core", "core", argv, core_addr, core_metrics, pki, _secret_env(options))
    return [*workers, core]


def start_frontend(options: StackOptions, core_addr: str, pki: LocalPki | None = None) -> Child:
    """Start a frontend on the engine core at `core_addr` (several may share one core)."""
    free_metrics_port, fe_port, free_http_port = free_ports(3)
    fe_metrics = options.metrics_port("frontend", free_metrics_port)
    host, port = options.host, options.grpc_port or fe_port
    http_port = options.http_port or free_http_port
    argv = [
        *model_flags(options)[1],
        *("--core-addr", core_addr, "--host", host, "--port", str(port)),
        *("--metrics-port", str(fe_metrics), "--http-port", str(http_port)),
        *_common_flags(options, "frontend"),
    ]
    env = _secret_env(options)  # in the environment, not in argv, where ps shows it
    if options.api_key:
        env[env_name("api_key")] = options.api_key
    frontend = _spawn("frontend", "frontend", argv, f"{host}:{port}", fe_metrics, pki, env)
    if http_port >= 0:
        frontend.http_address = f"{host}:{http_port}"
    return frontend


def is_ready(child: Child) -> bool:
    """True when the child's readiness health check answers SERVING (or its readiness URL
    200)."""
    if child.readiness_url:
        try:
            with urllib.request.urlopen(child.readiness_url, timeout=1.0) as reply:
                return bool(reply.status == 200)
        except (OSError, urllib.error.URLError):
            return False
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
            raise LaunchError(child.exit_reason(code))


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
    """Stop service by service, so a drain can finish: a gateway first, then the frontends (they
    stop admitting and let their requests finish, which needs the core and the workers), then
    the core, then the workers. Each service's processes get SIGTERM and `shutdown_timeout` +
    STOP_GRACE_SECONDS before SIGKILL."""
    for kind in ("gateway", "frontend", "core", "worker"):
        running = [c for c in children if c.kind == kind and c.process.poll() is None]
        for child in running:
            child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + shutdown_timeout + STOP_GRACE_SECONDS
        for child in running:
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
    for child in children:
        child.termination_message.unlink(missing_ok=True)

"""`splitserve up`: start worker ranks, engine core and frontend as child processes on loopback.

The launcher first resolves `--model` (and `--tokenizer`) as the services will, fetching what
needs fetching once; then it waits until every child reports SERVING on its readiness health
check, prints one `READY ...` line, optionally streams a sample answer, and keeps running. Ctrl-C
or SIGTERM stops every child; a child that dies takes the launcher down with a non-zero exit
naming it and the one-line reason it gave (its termination message).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve_runtime.flags import FlagParser, non_negative_int, positive_int
from splitserve_runtime.log_config import LOG_LEVELS, configure_logging
from splitserve_runtime.model_source import (
    add_model_arguments,
    resolve_model,
    resolve_tokenizer,
)
from splitserve_runtime.termination import TERMINATION_MESSAGE_ENV, read_termination_message

LOOPBACK = "127.0.0.1"
STOP_GRACE_SECONDS = 15.0
READINESS = {
    "worker": "splitserve.worker.v1.WorkerService",
    "core": "splitserve.core.v1.EngineCoreService",
    "frontend": "splitserve.frontend.v1.GenerationService",
}


@dataclass
class Child:
    """One service process started by the launcher."""

    name: str
    kind: str
    address: str
    metrics_url: str
    process: subprocess.Popen[bytes]
    termination_message: Path

    def exit_reason(self, code: int) -> str:
        reason = read_termination_message(self.termination_message)
        return f"{self.name} exited with code {code}" + (f": {reason}" if reason else "")


class LaunchError(RuntimeError):
    """A child failed to start or died."""


def build_parser() -> FlagParser:
    p = FlagParser(
        prog="splitserve up",
        description="Start the whole stack on loopback. Any other `splitserve core` flag "
        "(e.g. --max-model-len, --max-num-seqs, --dtype) is passed to the engine core.",
    )
    add_model_arguments(p, is_frontend=True)
    p.add_argument("--tensor-parallel-size", "--tp", type=positive_int, default=1)
    p.add_argument("--pipeline-parallel-size", "--pp", type=positive_int, default=1)
    p.add_argument("--host", default=LOOPBACK, help="frontend listen address")
    p.add_argument("--port", type=non_negative_int, default=50051, help="frontend port (0: any)")
    p.add_argument(
        "--sample-prompt",
        default="",
        help="after READY, stream the model's greedy answer to this prompt (a chat message when "
        "the model has a chat template) to stdout",
    )
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for READY")
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


def _spawn(name: str, kind: str, argv: list[str], address: str, metrics_port: int) -> Child:
    cmd = [sys.executable, "-m", f"{kind}_svc", *argv]
    fd, message_path = tempfile.mkstemp(prefix=f"splitserve-{kind}-", suffix=".termination")
    os.close(fd)
    process = subprocess.Popen(cmd, env={**os.environ, TERMINATION_MESSAGE_ENV: message_path})
    metrics_url = f"http://{LOOPBACK}:{metrics_port}/metrics"
    return Child(name, kind, address, metrics_url, process, Path(message_path))


def model_flags(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(core flags, frontend flags) naming the model as the operator did."""
    core = ["--model", args.model]
    if args.revision:
        core += ["--revision", args.revision]
    frontend = [*core, "--generation-config", args.generation_config]
    if args.tokenizer:
        frontend += ["--tokenizer", args.tokenizer]
    return core, frontend


def start_children(args: argparse.Namespace, core_flags: list[str]) -> list[Child]:
    """Start workers, core and frontend; they find each other through the ports chosen here."""
    world = args.tensor_parallel_size * args.pipeline_parallel_size
    ports = free_ports(2 * world + 5)
    common = ["--log-level", args.log_level]
    core_model, frontend_model = model_flags(args)
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
        )
        for rank in range(world)
    ]
    core_port, core_metrics, dist_port, fe_metrics, fe_port = ports[2 * world :]
    core_addr = f"{LOOPBACK}:{core_port}"
    core = _spawn(
        "core",
        "core",
        [
            *core_model,
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
            *core_flags,
        ],
        core_addr,
        core_metrics,
    )
    port = args.port or fe_port
    frontend = _spawn(
        "frontend",
        "frontend",
        [
            *frontend_model,
            "--core-addr",
            core_addr,
            "--host",
            args.host,
            "--port",
            str(port),
            "--metrics-port",
            str(fe_metrics),
            *common,
        ],
        f"{args.host}:{port}",
        fe_metrics,
    )
    return [*workers, core, frontend]


def is_ready(child: Child) -> bool:
    """True when the child's readiness health check answers SERVING."""
    host, port = child.address.rsplit(":", 1)
    target = f"{LOOPBACK if host in ('0.0.0.0', '') else host}:{port}"
    try:
        with grpc.insecure_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(
                health_pb2.HealthCheckRequest(service=READINESS[child.kind]), timeout=1.0
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


def stop_children(children: Sequence[Child]) -> None:
    """SIGTERM frontend first, then core, then workers; SIGKILL whatever outlives the grace."""
    for child in reversed(children):
        if child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for child in children:
        try:
            child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()
        child.termination_message.unlink(missing_ok=True)


def ready_line(children: Sequence[Child]) -> str:
    by_kind = {kind: [c for c in children if c.kind == kind] for kind in READINESS}
    return (
        f"READY frontend={by_kind['frontend'][0].address} core={by_kind['core'][0].address} "
        f"workers={','.join(c.address for c in by_kind['worker'])} "
        f"metrics={','.join(c.metrics_url for c in children)}"
    )


def stream_sample(address: str, prompt: str) -> None:
    """The greedy answer to `prompt`, as a chat message when the model has a chat template."""
    from splitserve.generate_client import build_parser as generate_parser
    from splitserve.generate_client import (
        build_request,
        has_chat_template,
        print_stream,
        stream_text,
    )

    argv = [prompt, "--max-tokens", "48", "--temperature", "0"]
    if has_chat_template(address):
        argv.append("--chat")
    args = generate_parser().parse(argv, {})
    print(f"sample prompt: {prompt}\nsample answer: ", end="", flush=True)
    print_stream(stream_text(address, build_request(args), 120.0), sys.stdout)


def _serve(children: list[Child], args: argparse.Namespace) -> int:
    wait_ready(children, args.startup_timeout)
    print(ready_line(children), flush=True)
    if args.sample_prompt:
        stream_sample(children[-1].address, args.sample_prompt)
    while True:
        check_alive(children)
        time.sleep(0.25)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    parser = build_parser()
    env = os.environ if environ is None else environ
    args, core_flags = parser.parse_known_env(argv, env)
    configure_logging(args.log_level, "launcher")  # e.g. the default model's first-use build
    try:
        # Fetch (or build) the model once, here, and refuse what the services would refuse.
        model = resolve_model(args.model, args.revision, env)
        resolve_tokenizer(model, args.tokenizer, args.revision, env)
    except (ValueError, OSError, RuntimeError) as err:
        print(f"splitserve up: {err}", file=sys.stderr)
        return 1
    children: list[Child] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    code, failure = 0, ""
    try:
        children = start_children(args, core_flags)
        code = _serve(children, args)
    except KeyboardInterrupt:
        print("splitserve up: stopping", file=sys.stderr)
    except (LaunchError, grpc.RpcError) as err:
        code = 1
        failure = err.details() if isinstance(err, grpc.RpcError) else str(err)
    finally:
        for signum in (
            signal.SIGINT,
            signal.SIGTERM,
        ):  # a second Ctrl-C must not cut the stop short
            signal.signal(signum, signal.SIG_IGN)
        stop_children(children)
    if failure:  # last, after the children's own goodbyes: the one line to read
        print(f"splitserve up: {failure}; stopped everything", file=sys.stderr)
    return code

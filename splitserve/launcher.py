"""`splitserve serve MODEL` (alias `splitserve up`, which `make run` uses): start worker ranks,
engine core and frontend as child processes on loopback.

As under `vllm serve`, `--port` is the OpenAI HTTP API's port (8000) and `--host` the address the
frontend listens on; the public gRPC port is `--grpc-port` (50051). The host defaults to
loopback here (`make run`, the tests, a laptop), where vLLM binds every interface: the container
image's entrypoint passes `--host 0.0.0.0` (docs/containers.md). `splitserve up` keeps its old
spelling, `--port` for the gRPC port, as a deprecated alias (with a warning).

Every service flag the launcher does not wire itself is a flag here too, passed to the service
that owns it (splitserve/serve_flags.py). The launcher first resolves the model (the positional
MODEL or `--model`) and `--tokenizer` as the services will, fetching what
needs fetching once. The internal hops (frontend -> core -> workers) use mutual TLS by default:
the launcher makes a throwaway CA and per-role certificates (splitserve/local_pki.py) in a
private temporary folder that it deletes on exit (`--no-internal-tls` for plaintext). It waits
until every child reports SERVING on its readiness health check, prints one `READY ...` line,
records the frontend's address for `splitserve generate` and `bench serve`
(splitserve_client/last_serve.py), optionally streams a sample answer (the services' log lines
held back until its line is complete: splitserve/held_logs.py), and keeps running. Ctrl-C or
SIGTERM drains and stops every child. Once the stack is ready, a child that exits is started again
with the same port and flags (splitserve/supervisor.py): a worker rank or an engine core comes back
and the requests in flight resume. A child that dies before the stack is ready, or keeps dying,
takes the launcher down with a non-zero exit naming it and the one-line reason it gave (its
termination message).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import Any

import grpc

from frontend_svc.config import DEFAULT_HTTP_PORT
from splitserve import data_parallel, pd
from splitserve.children import (
    LOOPBACK,
    Child,
    LaunchError,
    StackOptions,
    start_children,
    stop_children,
    wait_ready,
)
from splitserve.held_logs import HeldLogs
from splitserve.local_pki import LocalPki
from splitserve.serve_flags import add_service_flags, split_service_flags
from splitserve.supervisor import Supervisor
from splitserve_client.cli import distribution_version
from splitserve_client.last_serve import forget_serve, record_serve
from splitserve_runtime.flags import (
    Flag,
    FlagParser,
    add_flag_notice,
    env_name,
    flag,
    non_negative_int,
)
from splitserve_runtime.log_config import LOGGING_FLAGS, configure_logging
from splitserve_runtime.model_source import resolve_model, resolve_tokenizer
from splitserve_runtime.model_spec import model_flags
from splitserve_runtime.services import CORE, FRONTEND, SERVICES, WORKER
from splitserve_runtime.transport_flags import internal_secret_problem
from splitserve_runtime.vllm_compat import NO_EFFECT_FLAGS

logger = logging.getLogger("splitserve.launcher")
Sample = Callable[[str, str, str], None]
"""Streams the sample answer: (frontend address, prompt, API key)."""


METRICS_PORT_HELP = {
    FRONTEND: "the frontend's Prometheus /metrics port",
    CORE: "the engine core's Prometheus /metrics port",
    WORKER: "worker rank 0's Prometheus /metrics port; rank r uses this + r",
}
LAUNCHER_FLAGS: tuple[Flag, ...] = (
    flag(
        "model_tag",
        nargs="?",
        default="",
        metavar="MODEL",
        help="the model, as --model names it (vLLM's positional model)",
    ),
    flag("--version", action="version", version=f"splitserve {distribution_version('splitserve')}"),
    *model_flags(is_frontend=True),  # -tp and -pp come with the core's flags
    flag(
        "--host",
        default=LOOPBACK,
        help="address the frontend's HTTP and gRPC ports listen on (0.0.0.0: every interface, "
        "as vLLM's default and the container image's; the internal hops stay on loopback)",
    ),
    *(
        flag(
            f"--{spec.kind}-metrics-port",
            type=int,
            default=spec.default_metrics_port,
            help=f"{text} (0: any free port, -1: off)",
        )
        for spec, text in METRICS_PORT_HELP.items()
    ),
    flag(
        "--api-key",
        default="",
        help="the frontend's API key (clients send `authorization: Bearer <key>`); also "
        "SPLITSERVE_API_KEY",
    ),
    flag(
        "--sample-prompt",
        default="",
        help="after READY, stream the model's greedy answer to this prompt (a chat message when "
        "the model has a chat template) to stdout",
    ),
    *data_parallel.DATA_PARALLEL_FLAGS,
    *pd.PD_FLAGS,
    flag("--startup-timeout", type=float, default=900.0, help="seconds to wait for READY"),
    flag(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on Ctrl-C or SIGTERM, seconds running requests may take to finish (the frontend "
        "and the core stop admitting) before they are aborted",
    ),
    flag(
        "--max-recovery-seconds",
        type=float,
        default=120.0,
        help="when a worker rank or the engine core dies or hangs, requests in flight wait this "
        "long for it to be restarted and resume (engine core and frontend); 0: they fail at once",
    ),
    flag(
        "--internal-tls",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="mutual TLS between frontend, core and workers with a throwaway CA; without it the "
        "hops are plaintext on loopback and the launcher gives the services a random internal "
        "secret (or SPLITSERVE_INTERNAL_SECRET) that the core and the workers require",
    ),
    *LOGGING_FLAGS,
    *NO_EFFECT_FLAGS,
)
"""The launcher's own flags, in --help order (after them, the services' flags it passes on)."""
GRPC_PORT_HELP = "the frontend's public gRPC port (GenerationService, VllmEngine; 0: any)"
HTTP_PORT_HELP = "the frontend's OpenAI-compatible HTTP port (0: any, -1: off)"


class _OldGrpcPortSpelling(argparse._StoreAction):
    """`splitserve up --port N`: the gRPC port, as before `serve` took vLLM's meaning."""

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        option = args[2] if len(args) > 2 else kwargs.get("option_string")
        if option == "--port":
            add_flag_notice(
                "up --port",
                "`splitserve up --port` names the gRPC port, a deprecated spelling: use "
                "--grpc-port (under `splitserve serve`, --port is the HTTP port, as in vLLM)",
            )
        super().__call__(parser, *args, **kwargs)  # type: ignore[arg-type]


def port_flags(prog: str) -> tuple[Flag, ...]:
    """`serve`: --port is the HTTP port (vLLM's), --http-port its older name; `up`: --port is
    still the gRPC port (deprecated, warned), --http-port the HTTP one; --grpc-port in both."""
    grpc: dict[str, Any] = {
        "type": non_negative_int,
        "default": FRONTEND.default_port,
        "dest": "grpc_port",
    }
    http: dict[str, Any] = {"type": int, "default": DEFAULT_HTTP_PORT, "dest": "http_port"}
    if prog.endswith(" up"):
        return (
            flag("--grpc-port", "--port", action=_OldGrpcPortSpelling, help=GRPC_PORT_HELP, **grpc),
            flag("--http-port", help=HTTP_PORT_HELP, **http),
        )
    return (
        flag("--port", "--http-port", help=HTTP_PORT_HELP + " (vLLM's --port)", **http),
        flag("--grpc-port", help=GRPC_PORT_HELP, **grpc),
    )


def build_parser(prog: str = "splitserve serve") -> tuple[FlagParser, dict[str, list[str]]]:
    """The launcher's parser, and which services take each flag it passes on."""
    p = FlagParser(
        prog=prog,
        description="Serve a model: start worker ranks, engine core and frontend on loopback "
        "(vLLM's `vllm serve`). The core's, frontend's and worker's own flags are accepted "
        "too and passed to them.",
        config_file=True,
    )
    p.add_flags(LAUNCHER_FLAGS)
    p.add_flags(port_flags(prog))
    return p, add_service_flags(p)


def ready_line(children: Sequence[Child]) -> str:
    by_kind = {kind: [c for c in children if c.kind == kind] for kind in SERVICES}
    return (
        f"READY frontend={by_kind['frontend'][0].address} core={by_kind['core'][0].address} "
        f"workers={','.join(c.address for c in by_kind['worker'])} "
        f"metrics={','.join(c.metrics_url for c in children if c.metrics_url) or 'off'}"
        + "".join(f" http={c.http_address}" for c in by_kind["frontend"] if c.http_address)
    )


def stream_sample(
    address: str, prompt: str, api_key: str = "", logs: HeldLogs | None = None
) -> None:
    """The greedy answer to `prompt`, as a chat message when the model has a chat template;
    the services' log lines wait in `logs` until its line is complete."""
    from splitserve_client.generate import build_parser as generate_parser
    from splitserve_client.generate import (
        build_request,
        has_chat_template,
        print_stream,
        stream_text,
    )

    argv = [prompt, "--max-tokens", "48", "--temperature", "0"]
    if has_chat_template(address, api_key=api_key):
        argv.append("--chat")
    args = generate_parser().parse(argv, {})
    with logs.held() if logs is not None else contextlib.nullcontext():
        print(f"sample prompt: {prompt}\nsample answer: ", end="", flush=True)
        print_stream(stream_text(address, build_request(args), 120.0, api_key), sys.stdout)


def _serve(children: list[Child], args: argparse.Namespace, sample: Sample) -> int:
    wait_ready(children, args.startup_timeout)
    frontend = children[-1]
    try:  # first: READY means the clients can find it
        record_serve(frontend.address, frontend.http_address)
    except OSError as err:  # e.g. a read-only home: the clients then need --addr
        logger.warning("could not record the address for the clients: %s", err)
    sys.stdout.write(ready_line(children) + "\n")  # one write: no log line lands inside it
    sys.stdout.flush()
    if args.sample_prompt:
        sample(children[-1].address, args.sample_prompt, args.api_key)
    supervisor = Supervisor(children, report=_report)
    while True:
        supervisor.poll()
        time.sleep(0.25)


def _report(line: str) -> None:
    print(f"splitserve up: {line}", file=sys.stderr, flush=True)


def _run(args: argparse.Namespace) -> tuple[int, str]:
    """Start, serve, and stop the stack: (exit code, the one-line failure or "")."""
    children: list[Child] = []
    pki_context = LocalPki() if args.internal_tls else contextlib.nullcontext(None)
    code, failure = 0, ""
    logs = HeldLogs() if args.sample_prompt else None  # before the children: they inherit it
    sample: Sample = functools.partial(stream_sample, logs=logs)
    with pki_context as pki, contextlib.closing(logs) if logs else contextlib.nullcontext():
        try:
            if args.data_parallel_size > 1:  # N engines and the gateway (data_parallel.py)
                code = data_parallel.serve(args, pki, children, _report, sample)
            else:
                children = start_children(StackOptions.from_args(args), pki)
                code = _serve(children, args, sample)
        except KeyboardInterrupt:
            logger.info("stopping")
        except (LaunchError, grpc.RpcError) as err:
            code = 1
            failure = err.details() if isinstance(err, grpc.RpcError) else str(err)
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut it short
                signal.signal(signum, signal.SIG_IGN)
            forget_serve()
            stop_children(children, args.shutdown_timeout)  # before the certificates go
    return code, failure


def parse_args(
    argv: Sequence[str] | None, environ: Mapping[str, str], prog: str = "splitserve serve"
) -> argparse.Namespace:
    """The launcher's flags; `service_flags` holds the tokens to pass to each service kind."""
    parser, owners = build_parser(prog)
    tokens = parser.expand(argv, environ)
    args = parser.parse_args(tokens)
    if args.model_tag and args.model and args.model_tag != args.model:
        parser.error(f"the model is named twice: {args.model_tag!r} and --model {args.model!r}")
    args.model = args.model_tag or args.model
    if args.max_recovery_seconds < 0:
        parser.error("--max-recovery-seconds must be >= 0")
    pd.check_args(args, parser)  # --pd P:D is P + D data-parallel engines, in roles
    data_parallel.check_args(args, parser)
    args.service_flags = split_service_flags(tokens, parser, owners)
    args.internal_secret = internal_secret(args, environ)
    problem = internal_secret_problem(args.internal_secret)
    if problem:
        parser.error(f"{env_name('internal_secret')}: {problem}")
    return args


def internal_secret(args: argparse.Namespace, environ: Mapping[str, str]) -> str:
    """The services' --internal-secret: SPLITSERVE_INTERNAL_SECRET when set; else, for plaintext
    internal hops, a fresh random one (no stranger on this machine can then drive the core or a
    worker through their loopback ports); else none (mutual TLS admits only the stack's roles)."""
    given = environ.get(env_name("internal_secret"), "")
    if given or args.internal_tls:
        return given
    return secrets.token_urlsafe(32)


def main(
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    prog: str = "splitserve serve",
) -> int:
    env = os.environ if environ is None else environ
    args = parse_args(argv, env, prog)
    configure_logging(args.log_level, "launcher", args.log_format)  # e.g. a first-use build
    try:
        # Fetch (or build) the model once, here, and refuse what the services would refuse.
        model = resolve_model(args.model, args.revision, env)
        resolve_tokenizer(model, args.tokenizer, args.revision, env)
    except (ValueError, OSError, RuntimeError) as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 1

    def on_signal(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    code, failure = _run(args)
    if failure:  # last, after the children's own goodbyes: the one line to read
        print(f"{prog}: {failure}; stopped everything", file=sys.stderr)
    return code

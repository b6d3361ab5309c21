"""`splitserve up`: start worker ranks, engine core and frontend as child processes on loopback.

The launcher first resolves `--model` (and `--tokenizer`) as the services will, fetching what
needs fetching once. The internal hops (frontend -> core -> workers) use mutual TLS by default:
the launcher makes a throwaway CA and per-role certificates (splitserve/local_pki.py) in a
private temporary folder that it deletes on exit (`--no-internal-tls` for plaintext). It waits
until every child reports SERVING on its readiness health check, prints one `READY ...` line,
optionally streams a sample answer, and keeps running. Ctrl-C or SIGTERM drains and stops every
child. Once the stack is ready, a child that exits is started again with the same port and flags
(splitserve/supervisor.py): a worker rank or an engine core comes back and the requests in flight
resume. A child that dies before the stack is ready, or keeps dying, takes the launcher down
with a non-zero exit naming it and the one-line reason it gave (its termination message).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from types import FrameType

import grpc

from frontend_svc.config import DEFAULT_HTTP_PORT
from splitserve.children import (
    LOOPBACK,
    Child,
    LaunchError,
    start_children,
    stop_children,
    wait_ready,
)
from splitserve.local_pki import LocalPki
from splitserve.supervisor import Supervisor
from splitserve_runtime.flags import FlagParser, non_negative_int, positive_int
from splitserve_runtime.log_config import LOG_LEVELS, configure_logging
from splitserve_runtime.model_source import resolve_model, resolve_tokenizer
from splitserve_runtime.model_spec import add_model_arguments
from splitserve_runtime.services import FRONTEND, SERVICES


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
        help="after READY, stream the model's greedy answer to this prompt (a chat message when "
        "the model has a chat template) to stdout",
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
        "--max-recovery-seconds",
        type=float,
        default=120.0,
        help="when a worker rank or the engine core dies or hangs, requests in flight wait this "
        "long for it to be restarted and resume (engine core and frontend); 0: they fail at once",
    )
    p.add_argument(
        "--internal-tls",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="mutual TLS between frontend, core and workers with a throwaway CA",
    )
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    return p


def ready_line(children: Sequence[Child]) -> str:
    by_kind = {kind: [c for c in children if c.kind == kind] for kind in SERVICES}
    return (
        f"READY frontend={by_kind['frontend'][0].address} core={by_kind['core'][0].address} "
        f"workers={','.join(c.address for c in by_kind['worker'])} "
        f"metrics={','.join(c.metrics_url for c in children)}"
        + "".join(f" http={c.http_address}" for c in by_kind["frontend"] if c.http_address)
    )


def stream_sample(address: str, prompt: str, api_key: str = "") -> None:
    """The greedy answer to `prompt`, as a chat message when the model has a chat template."""
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
    print(f"sample prompt: {prompt}\nsample answer: ", end="", flush=True)
    print_stream(stream_text(address, build_request(args), 120.0, api_key), sys.stdout)


def _serve(children: list[Child], args: argparse.Namespace) -> int:
    wait_ready(children, args.startup_timeout)
    print(ready_line(children), flush=True)
    if args.sample_prompt:
        stream_sample(children[-1].address, args.sample_prompt, args.api_key)
    supervisor = Supervisor(children, report=_report)
    while True:
        supervisor.poll()
        time.sleep(0.25)


def _report(line: str) -> None:
    print(f"splitserve up: {line}", file=sys.stderr, flush=True)


def _run(args: argparse.Namespace, core_flags: list[str]) -> tuple[int, str]:
    """Start, serve, and stop the stack: (exit code, the one-line failure or "")."""
    children: list[Child] = []
    pki_context = LocalPki() if args.internal_tls else contextlib.nullcontext(None)
    code, failure = 0, ""
    with pki_context as pki:
        try:
            children = start_children(args, core_flags, pki)
            code = _serve(children, args)
        except KeyboardInterrupt:
            print("splitserve up: stopping", file=sys.stderr)
        except (LaunchError, grpc.RpcError) as err:
            code = 1
            failure = err.details() if isinstance(err, grpc.RpcError) else str(err)
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut it short
                signal.signal(signum, signal.SIG_IGN)
            stop_children(children, args.shutdown_timeout)  # before the certificates go
    return code, failure


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    parser = build_parser()
    env = os.environ if environ is None else environ
    args, core_flags = parser.parse_known_env(argv, env)
    if args.max_recovery_seconds < 0:
        parser.error("--max-recovery-seconds must be >= 0")
    configure_logging(args.log_level, "launcher")  # e.g. the default model's first-use build
    try:
        # Fetch (or build) the model once, here, and refuse what the services would refuse.
        model = resolve_model(args.model, args.revision, env)
        resolve_tokenizer(model, args.tokenizer, args.revision, env)
    except (ValueError, OSError, RuntimeError) as err:
        print(f"splitserve up: {err}", file=sys.stderr)
        return 1

    def on_signal(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    code, failure = _run(args, core_flags)
    if failure:  # last, after the children's own goodbyes: the one line to read
        print(f"splitserve up: {failure}; stopped everything", file=sys.stderr)
    return code

"""The `splitserve` command: run the stack or one service, generate text, benchmark."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from splitserve_client.cli import CLIENT_COMMANDS, Command, dispatch

USAGE = """usage: splitserve COMMAND [ARGS...]

commands:
  serve      serve a model (`splitserve serve MODEL [flags]`, as `vllm serve`): start workers,
             engine core and frontend on loopback; print READY; keep serving
  up         the same (`--model MODEL`; what `make run` uses)
  frontend   run the public gRPC frontend service (vLLM's P0)
  core       run the engine core service (vLLM's P1)
  worker     run one worker rank service
  generate   stream a completion from a running frontend to stdout
  bench      benchmarks (`splitserve bench serve --help`)

Run `splitserve COMMAND --help` for a command's flags, `splitserve --version` for the version.
"""


def _serve(argv: Sequence[str]) -> int:
    from splitserve.launcher import main

    return main(argv, prog="splitserve serve")


def _up(argv: Sequence[str]) -> int:
    from splitserve.launcher import main

    return main(argv, prog="splitserve up")


def _frontend(argv: Sequence[str]) -> int:
    from frontend_svc.main import main

    return main(argv)


def _core(argv: Sequence[str]) -> int:
    from core_svc.main import main

    return main(argv)


def _worker(argv: Sequence[str]) -> int:
    from worker_svc.main import main

    return main(argv)


COMMANDS: dict[str, Command] = {
    "serve": _serve,
    "up": _up,
    "frontend": _frontend,
    "core": _core,
    "worker": _worker,
    **CLIENT_COMMANDS,
}


def main(argv: Sequence[str] | None = None) -> int:
    from splitserve_runtime.log_limits import quiet_grpc_core_logs

    quiet_grpc_core_logs()  # before any command imports grpc
    return dispatch(argv, COMMANDS, USAGE, distribution="splitserve")


if __name__ == "__main__":
    sys.exit(main())

"""The `splitserve` command: run the stack or one service, generate text, benchmark."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from splitserve_client.cli import CLIENT_COMMANDS, Command, dispatch

USAGE = """usage: splitserve COMMAND [ARGS...]

commands:
  up         start workers, engine core and frontend on loopback; print READY; keep serving
  frontend   run the public gRPC frontend service (vLLM's P0)
  core       run the engine core service (vLLM's P1)
  worker     run one worker rank service
  generate   stream a completion from a running frontend to stdout
  bench      benchmarks (`splitserve bench serve --help`)

Run `splitserve COMMAND --help` for a command's flags.
"""


def _up(argv: Sequence[str]) -> int:
    from splitserve.launcher import main

    return main(argv)


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
    "up": _up,
    "frontend": _frontend,
    "core": _core,
    "worker": _worker,
    **CLIENT_COMMANDS,
}


def main(argv: Sequence[str] | None = None) -> int:
    from splitserve_runtime.log_limits import quiet_grpc_core_logs

    quiet_grpc_core_logs()  # before any command imports grpc
    return dispatch(argv, COMMANDS, USAGE)


if __name__ == "__main__":
    sys.exit(main())

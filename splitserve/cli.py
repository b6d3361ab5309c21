"""The `splitserve` command: run the stack or one service, generate text, benchmark."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

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


def _generate(argv: Sequence[str]) -> int:
    from splitserve.generate_client import main

    return main(argv)


def _bench(argv: Sequence[str]) -> int:
    from benchmarks.serve import main

    if not argv or argv[0] != "serve":
        print("usage: splitserve bench serve [--help]", file=sys.stderr)
        return 2
    return main(argv[1:])


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "up": _up,
    "frontend": _frontend,
    "core": _core,
    "worker": _worker,
    "generate": _generate,
    "bench": _bench,
}


def main(argv: Sequence[str] | None = None) -> int:
    from splitserve_runtime.log_limits import quiet_grpc_core_logs

    quiet_grpc_core_logs()  # before any command imports grpc
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if args else 2
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"splitserve: unknown command {args[0]!r}\n\n{USAGE}", file=sys.stderr, end="")
        return 2
    return command(args[1:])


if __name__ == "__main__":
    sys.exit(main())

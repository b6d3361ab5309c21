"""The client commands of `splitserve` (`generate`, `bench serve`), and the whole `splitserve`
command of the light splitserve-client distribution."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence

USAGE = """usage: splitserve COMMAND [ARGS...]

commands (splitserve-client, the light client without torch):
  generate   stream a completion from a running frontend to stdout
  bench      benchmarks (`splitserve bench serve --help`)

Run `splitserve COMMAND --help` for a command's flags. Serving (`up`, `frontend`, `core`,
`worker`) needs the full splitserve package. `splitserve --version` prints the version.
"""
SERVER_COMMANDS = ("serve", "up", "frontend", "core", "worker")
Command = Callable[[Sequence[str]], int]


def generate(argv: Sequence[str]) -> int:
    from splitserve_client.generate import main

    return main(argv)


def bench(argv: Sequence[str]) -> int:
    if not argv or argv[0] != "serve":
        print("usage: splitserve bench serve [--help]", file=sys.stderr)
        return 2
    from splitserve_client.bench_serve import main

    return main(argv[1:])


CLIENT_COMMANDS: dict[str, Command] = {
    "generate": generate,
    "bench": bench,
}


def dispatch(
    argv: Sequence[str] | None,
    commands: Mapping[str, Command],
    usage: str,
    distribution: str = "splitserve-client",
) -> int:
    """Run `splitserve COMMAND ARGS...` with one of `commands`; usage on -h or nothing, the
    installed `distribution`'s version on --version."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage, end="")
        return 0 if args else 2
    if args[0] in ("-v", "--version"):
        print(f"{distribution} {distribution_version(distribution)}")
        return 0
    command = commands.get(args[0])
    if command is not None:
        return command(args[1:])
    if args[0] in SERVER_COMMANDS:
        print(
            f"splitserve: {args[0]!r} serves models and needs the full splitserve package; "
            "this is splitserve-client, which only has `generate` and `bench serve`",
            file=sys.stderr,
        )
    else:
        print(f"splitserve: unknown command {args[0]!r}\n\n{usage}", file=sys.stderr, end="")
    return 2


def distribution_version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    return dispatch(argv, CLIENT_COMMANDS, USAGE)


if __name__ == "__main__":
    sys.exit(main())

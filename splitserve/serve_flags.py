"""The flags of `splitserve serve` (and `up`) that belong to one service: every flag of
`splitserve core`, `frontend` and `worker` that the launcher does not set itself is also a flag of
the launcher (so `--help` lists it with its default, a typo or a prefix is an error before anything
starts, and a positional MODEL is never mistaken for a value), and is passed on, as typed, to every
process of the services that have it (`--served-model-name`: the core and the frontend).
"""

from __future__ import annotations

from collections.abc import Sequence

from splitserve_runtime.flags import Flag, FlagParser

LAUNCHER_WIRED = frozenset(
    {
        # Where each service listens and whom it calls: the launcher picks free loopback ports.
        "--worker-addrs",
        "--distributed-init-method",
        "--core-addr",
        "--metrics-port",
        "--http-host",
        "--health-port",
        "--enable-reflection",
        # The launcher's throwaway CA secures the internal hops; it probes its frontend in
        # plaintext, so the public port's TLS is not offered here.
        "--tls-cert-file",
        "--tls-key-file",
        "--tls-ca-file",
        "--ssl-certfile",
        "--ssl-keyfile",
        "--ssl-ca-certs",
        # Without internal TLS the launcher makes an internal secret (or takes
        # SPLITSERVE_INTERNAL_SECRET) and gives it to every service through its environment.
        "--internal-secret",
    }
)
"""Service flags the launcher sets itself for its loopback stack."""
SERVICE_KINDS = ("core", "frontend", "worker")


def _service_tables() -> dict[str, Sequence[Flag]]:
    from core_svc.core_flags import CORE_FLAGS
    from frontend_svc.config import FRONTEND_FLAGS
    from worker_svc.config import WORKER_FLAGS

    return {"core": CORE_FLAGS, "frontend": FRONTEND_FLAGS, "worker": WORKER_FLAGS}


def add_service_flags(parser: FlagParser) -> dict[str, list[str]]:
    """Add the services' own flags (their tables) to `parser`, one group per service, the
    core's first (a flag several services have is listed under the first); returns option
    string -> the service kinds that take it."""
    owners: dict[str, list[str]] = {}
    for kind, table in _service_tables().items():
        rows = []
        for row in table:
            if row.names[0] in owners:  # another service's flag too: passed to both
                for option in row.names:
                    owners[option].append(kind)
            elif not any(parser.has_flag(o) or o in LAUNCHER_WIRED for o in row.names):
                rows.append(row)
        parser.add_flags(rows, group=f"{kind} flags (passed to `splitserve {kind}`)")
        for row in rows:
            owners.update({option: [kind] for option in row.names})
    return owners


def split_service_flags(
    tokens: Sequence[str], parser: FlagParser, owners: dict[str, list[str]]
) -> dict[str, list[str]]:
    """The command-line tokens (already parsed by `parser`, so well formed) of each service's
    flags, in order: service kind -> tokens."""
    out: dict[str, list[str]] = {kind: [] for kind in SERVICE_KINDS}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "--":
            break
        option, has_value, _ = token.partition("=")
        action = parser._option_string_actions.get(option) if token.startswith("-") else None
        takes_value = action is not None and action.nargs != 0 and not has_value
        width = 2 if takes_value else 1
        if takes_value and action is not None and action.nargs in ("+", "*"):
            while i + width < len(tokens) and not tokens[i + width].startswith("-"):
                width += 1  # `--served-model-name a b`: every value up to the next flag
        if action is not None and option in owners:
            for kind in owners[option]:
                out[kind] += tokens[i : i + width]
        i += width
    return out

"""The transport-security flags every service shares: mutual TLS on internal hops, reflection,
and a plaintext health-only port (see docs/reliability.md#security)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from splitserve_runtime.flags import Flag, flag
from splitserve_runtime.tls import TlsConfigError, TlsFiles

INTERNAL_TLS_FLAGS = "--tls-cert-file, --tls-key-file and --tls-ca-file"
LOOPBACK = "127.0.0.1"
MIN_INTERNAL_SECRET_CHARS = 16


def internal_tls_flags(hop: str) -> list[Flag]:
    """--tls-cert-file/--tls-key-file/--tls-ca-file: mutual TLS on `hop`."""
    return [
        flag(
            "--tls-cert-file",
            default="",
            help=f"PEM certificate for mutual TLS on {hop}; its names (CN or SAN) must include "
            "this service's role (splitserve-frontend, -core or -worker). All three --tls-* or "
            "none: without them the hop is plaintext",
        ),
        flag("--tls-key-file", default="", help="PEM private key of --tls-cert-file"),
        flag(
            "--tls-ca-file", default="", help="PEM CA bundle that the peers' certificates chain to"
        ),
        flag(
            "--internal-secret",
            default="",
            help="a secret shared by the deployment's frontends, engine core and workers (at "
            f"least {MIN_INTERNAL_SECRET_CHARS} characters): the core and the workers refuse calls "
            "that do not present it (UNAUTHENTICATED), and this service presents it on its own "
            "calls. For plaintext internal hops, which are otherwise open to anyone who reaches "
            "the ports; with mutual TLS an extra check. Prefer the environment "
            "(SPLITSERVE_INTERNAL_SECRET): command lines are visible to every user of the "
            "machine",
        ),
    ]


def listener_flags(*, reflection_default: bool) -> list[Flag]:
    """--enable-reflection and --health-port."""
    return [
        flag(
            "--enable-reflection",
            action=argparse.BooleanOptionalAction,
            default=reflection_default,
            help="serve gRPC server reflection (lists the API to anyone who can call the port)",
        ),
        flag(
            "--health-port",
            type=int,
            default=-1,
            help="also serve grpc.health.v1 alone, in plaintext, on this port (for probes that "
            "cannot present certificates, e.g. Kubernetes gRPC probes; -1: none)",
        ),
    ]


@dataclass(frozen=True, kw_only=True)
class TransportConfig:
    """The fields of these flags, shared by every service's config (a base class)."""

    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_ca_file: str = ""
    internal_secret: str = field(default="", repr=False)
    enable_reflection: bool = False
    health_port: int | None = None

    @property
    def tls(self) -> TlsFiles | None:
        """Mutual TLS files of the service's internal hops (None: plaintext). The core uses
        its certificate both to serve the frontends and as its client certificate to the
        workers; the frontend only as the client of the core."""
        if not self.tls_cert_file:
            return None
        return TlsFiles(self.tls_cert_file, self.tls_key_file, self.tls_ca_file)


def check_internal_tls(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with a usage error unless all three --tls-* flags or none are given, readable, and
    an --internal-secret, when given, is long enough."""
    problem = internal_secret_problem(args.internal_secret)
    if problem:
        parser.error(problem)
    try:
        TlsFiles.from_flags(
            args.tls_cert_file,
            args.tls_key_file,
            args.tls_ca_file,
            needs_ca=True,
            flag_names=INTERNAL_TLS_FLAGS,
        )
    except TlsConfigError as err:
        parser.error(str(err))


def internal_secret_problem(secret: str) -> str:
    """Why `secret` cannot be an --internal-secret ("" when it can, or when none is given)."""
    if secret and (
        len(secret) < MIN_INTERNAL_SECRET_CHARS or not all("!" <= c <= "~" for c in secret)
    ):
        return (
            f"--internal-secret must have at least {MIN_INTERNAL_SECRET_CHARS} characters, each "
            "printable ASCII other than a space (it travels as gRPC metadata)"
        )
    return ""


def optional_port(value: int) -> int | None:
    """-1 (or any negative) means no port."""
    return None if value < 0 else value

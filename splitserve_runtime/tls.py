"""Transport security of the services' gRPC ports: credentials from PEM files, and who the peer
is.

Internal hops (frontend -> core -> workers) use mutual TLS with one CA per deployment. Every
service presents a certificate whose names (subject CN and SAN DNS entries) include its ROLE:

    splitserve-frontend   the frontends (clients of the core)
    splitserve-core       the engine core (server to the frontends, client of the workers)
    splitserve-worker     the worker ranks (servers to the core)

A client checks the server's role instead of its address (`grpc.ssl_target_name_override`), so a
certificate does not depend on pod IPs; a server checks the client's role per service
(`splitserve_runtime.rpc_guard`): workers serve only the core, the core serves only frontends.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

FRONTEND_ROLE = "splitserve-frontend"
CORE_ROLE = "splitserve-core"
WORKER_ROLE = "splitserve-worker"
ROLES = (FRONTEND_ROLE, CORE_ROLE, WORKER_ROLE)
ROLE_OF_SERVICE = {"frontend": FRONTEND_ROLE, "core": CORE_ROLE, "worker": WORKER_ROLE}
"""By the service kinds of splitserve_runtime.services."""


class TlsConfigError(ValueError):
    """Certificate flags that do not fit together, or files that cannot be read."""


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files of one TLS end: its certificate chain, its private key and the CA bundle it
    trusts (for a server: the CA its clients' certificates must chain to; may be empty on a
    public port that does not ask for client certificates)."""

    cert_file: str
    key_file: str
    ca_file: str = ""

    @classmethod
    def from_flags(
        cls, cert_file: str, key_file: str, ca_file: str, *, needs_ca: bool, flag_names: str
    ) -> TlsFiles | None:
        """None when no file is given; raises TlsConfigError when only some are."""
        given = [bool(cert_file), bool(key_file)] + ([bool(ca_file)] if needs_ca else [])
        if not any(given) and not ca_file:
            return None
        if not all(given):
            raise TlsConfigError(f"give all of {flag_names} or none of them")
        files = cls(cert_file, key_file, ca_file)
        files.read()  # fail at start-up, not at the first handshake
        return files

    def read(self) -> tuple[bytes, bytes, bytes | None]:
        """(certificate chain, private key, CA bundle or None)."""
        return (
            _read(self.cert_file, "certificate"),
            _read(self.key_file, "private key"),
            _read(self.ca_file, "CA bundle") if self.ca_file else None,
        )


def _read(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise TlsConfigError(f"cannot read the {what} file {path!r}: {err.strerror}") from err
    if b"-----BEGIN " not in data:
        raise TlsConfigError(f"the {what} file {path!r} is not PEM")
    return data


def server_credentials(files: TlsFiles, *, require_client_auth: bool) -> grpc.ServerCredentials:
    """Credentials of a server port; with `require_client_auth` a client without a certificate
    signed by `files.ca_file` fails the handshake."""
    cert, key, ca = files.read()
    if require_client_auth and ca is None:
        raise TlsConfigError("requiring client certificates needs a CA bundle")
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=require_client_auth
    )


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """Client credentials: trust `files.ca_file`, present `files.cert_file`."""
    cert, key, ca = files.read()
    return grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )


def peer_names(context: Any) -> frozenset[str]:
    """The names in the peer's verified certificate (CN and SAN entries); empty under
    plaintext. `context` is a sync or grpc.aio ServicerContext."""
    auth = context.auth_context()
    raw = [*auth.get("x509_common_name", ()), *auth.get("x509_subject_alternative_name", ())]
    return frozenset(name.decode(errors="replace") for name in raw)


def peer_identity(context: Any) -> str:
    """A stable identity of the peer: its certificate's names, sorted ("" under plaintext).
    Unlike a fingerprint it survives certificate rotation."""
    return ",".join(sorted(peer_names(context)))


def is_secure(context: Any) -> bool:
    """Whether the call arrived over TLS."""
    return context.auth_context().get("transport_security_type") == [b"ssl"]

"""A throwaway certificate authority, so `splitserve up` encrypts its internal hops by default.

`LocalPki` makes a fresh CA and one certificate per role (splitserve-frontend, -core, -worker,
plus one for the launcher's own health probes) in a private temporary folder (0700, keys 0600),
valid for a few days, and deletes the folder on exit. Nothing is reused between runs: the CA's
key never leaves this process's lifetime, so no other deployment can trust it.
"""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from splitserve_runtime.tls import ROLES, TlsFiles

LAUNCHER_IDENTITY = "splitserve-launcher"
VALIDITY = datetime.timedelta(days=7)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _private_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def write_private(path: Path, data: bytes) -> None:
    """Write `data` readable by this user only (0600 from the start, never wider)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


class CertificateAuthority:
    """An in-memory CA (ECDSA P-256) that issues leaf certificates for given names."""

    def __init__(self, common_name: str = "splitserve throwaway CA") -> None:
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(_name(common_name))
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )

    @property
    def ca_pem(self) -> bytes:
        return self._cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, names: Sequence[str]) -> tuple[bytes, bytes]:
        """(certificate PEM, private key PEM) with CN = names[0] and every name as SAN DNS, for
        both TLS server and client use."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(names[0]))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .add_extension(
                x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False
            )
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM), _private_pem(key)

    def write(self, folder: Path, stem: str, names: Sequence[str]) -> TlsFiles:
        """Issue a certificate for `names` into `folder` (stem.crt, stem.key 0600, ca.crt)."""
        cert, key = self.issue(names)
        ca_file = folder / "ca.crt"
        if not ca_file.exists():
            ca_file.write_bytes(self.ca_pem)
        (folder / f"{stem}.crt").write_bytes(cert)
        write_private(folder / f"{stem}.key", key)
        return TlsFiles(str(folder / f"{stem}.crt"), str(folder / f"{stem}.key"), str(ca_file))


class LocalPki:
    """Context manager: a fresh CA and per-role certificates in a private temporary folder,
    deleted on exit. `files[role]` are the TlsFiles of each role and of LAUNCHER_IDENTITY;
    `ca` may issue more (tests do)."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="splitserve-pki-"))  # mode 0700
        self.files: dict[str, TlsFiles] = {}
        self.ca = CertificateAuthority()

    def __enter__(self) -> LocalPki:
        try:
            for identity in (*ROLES, LAUNCHER_IDENTITY):
                self.files[identity] = self.ca.write(self.folder, identity, [identity])
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

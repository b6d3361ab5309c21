"""Fixtures of the security tests: a throwaway PKI and a stack whose internal hops use it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from splitserve.local_pki import CertificateAuthority, LocalPki
from splitserve_runtime.tls import ROLES, TlsFiles
from tests.e2e.stack import Stack
from tests.security.peers import issue


@pytest.fixture(scope="module")
def pki() -> Iterator[LocalPki]:
    with LocalPki() as made:
        yield made


@pytest.fixture(scope="module")
def foreign(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsFiles]:
    """Certificates with the right role names, signed by another CA."""
    folder = tmp_path_factory.mktemp("foreign-ca")
    ca = CertificateAuthority("someone else's CA")
    return {role: issue(ca, folder, role, [role]) for role in ROLES}


@pytest.fixture(scope="module")
def secure_stack(tiny_model_dir: Path, pki: LocalPki) -> Iterator[Stack]:
    stack = Stack(tiny_model_dir, pki=pki).start()
    yield stack
    stack.stop()

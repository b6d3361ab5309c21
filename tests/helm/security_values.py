"""Values of the chart's transport-security options for the helm tests, the Secrets a user would
create for them (real certificates from a throwaway CA), and the files a pod's Secret volumes
put where its flags point."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from splitserve.local_pki import CertificateAuthority
from splitserve_runtime.tls import ROLE_OF_SERVICE
from tests.helm.chart_render import Doc, Manifests, pod_spec

ROLES = ("frontend", "core", "worker")
API_KEY_SECRET, API_KEY = "llm-api-key", "sk-test-key"
PUBLIC_TLS_SECRET = "llm-public-tls"
PUBLIC_HOST = "localhost"  # the public certificate's name (tests connect to localhost)

TLS_OFF: dict[str, Any] = {"tls": {"internal": {"enabled": False}}}
# Every role's certificate from a Secret the user made (e.g. with cert-manager), an API key, TLS
# on the public ports with client certificates, and both Ingresses.
GIVEN: dict[str, Any] = {
    "tls": {"internal": {"existingSecrets": {r: f"llm-internal-{r}" for r in ROLES}}},
    "frontend": {
        "apiKey": {"secretName": API_KEY_SECRET, "key": "key"},
        "ssl": {"secretName": PUBLIC_TLS_SECRET, "requireClientCertificate": True},
        "ingress": {"enabled": True, "hosts": ["grpc.example.com"]},
        "httpIngress": {"enabled": True, "hosts": ["llm.example.com"]},
    },
    "worker": {"shutdownTimeout": 40},
}
# The user's internal certificates, an API key and TLS on the public ports: what the local
# launch runs (clients need no certificate there; they trust the public CA).
GIVEN_LAUNCHED: dict[str, Any] = {
    "tls": GIVEN["tls"],
    "frontend": {
        "apiKey": GIVEN["frontend"]["apiKey"],
        "ssl": {"secretName": PUBLIC_TLS_SECRET},
    },
}


def _pem_data(authority: CertificateAuthority, names: list[str]) -> dict[str, str]:
    cert, key = authority.issue(names)
    return {"tls.crt": cert.decode(), "tls.key": key.decode(), "ca.crt": authority.ca_pem.decode()}


def user_secrets() -> dict[str, dict[str, str]]:
    """The Secrets GIVEN names, as a user would create them (name -> data, PEM text)."""
    internal, public = CertificateAuthority("internal CA"), CertificateAuthority("public CA")
    secrets = {
        f"llm-internal-{role}": _pem_data(internal, [ROLE_OF_SERVICE[role]]) for role in ROLES
    }
    secrets[PUBLIC_TLS_SECRET] = _pem_data(public, [PUBLIC_HOST])
    secrets[API_KEY_SECRET] = {"key": API_KEY}
    return secrets


def secret_data(
    manifests: Manifests, name: str, given: dict[str, dict[str, str]]
) -> dict[str, str]:
    """A Secret's data as text: one the chart renders, else one the user made."""
    for doc in manifests.of_kind("Secret"):
        if doc["metadata"]["name"] == name:
            return {k: base64.b64decode(v).decode() for k, v in doc.get("data", {}).items()}
    return given[name]


def mount_secrets(
    manifests: Manifests,
    workload: Doc,
    container: Doc,
    root: Path,
    given: dict[str, dict[str, str]] | None = None,
) -> dict[str, Path]:
    """Write the container's Secret volumes (their `items`) under `root`; mountPath -> folder."""
    volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
    folders = {}
    for mount in container.get("volumeMounts", []):
        secret = volumes[mount["name"]].get("secret")
        if secret is None:
            continue
        data = secret_data(manifests, secret["secretName"], given or {})
        folder = root / mount["name"]
        folder.mkdir(parents=True, exist_ok=True)
        for item in secret.get("items") or [{"key": k, "path": k} for k in data]:
            (folder / item["path"]).write_text(data[item["key"]])
        folders[mount["mountPath"]] = folder
    return folders


def translate(args: list[str], folders: dict[str, Path]) -> list[str]:
    """`args` with each path under a mount replaced by the folder holding its files."""
    out = []
    for arg in args:
        for mount_path, folder in folders.items():
            if arg.startswith(mount_path + "/"):
                arg = str(folder) + arg[len(mount_path) :]
        out.append(arg)
    return out

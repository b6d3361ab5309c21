"""Print the pinned runtime closure of splitserve, for docker/requirements.txt.

Run it with the interpreter of an environment where splitserve's dependencies are installed (the
root requirements are read from this repository's pyproject.toml, so a stale install of
splitserve itself does not matter):

    .venv/bin/python docker/lock_requirements.py > docker/requirements.txt

torch is left out on purpose: the Dockerfile installs it from the PyTorch index of each image
variant (CPU or CUDA), constrained by this file.
"""

from __future__ import annotations

import importlib.metadata as md
import sys
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

HEADER = """\
# Pinned runtime dependencies of the splitserve images (the closure of pyproject.toml's
# [project].dependencies, resolved for CPython {py} on linux x86_64). torch is not listed here:
# the Dockerfile installs it from the PyTorch index of the image variant (cpu or CUDA) with this
# file as a constraint. Refresh with docker/lock_requirements.py after changing pyproject.toml.
"""
LEFT_OUT = {"torch"}


def _applies(req: Requirement, extras: set[str], env: dict[str, str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": e}) for e in (extras or {""}))


PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def root_requirements() -> list[str]:
    """splitserve's runtime dependencies, as pyproject.toml declares them."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    return list(project["dependencies"])


def closure(roots: list[str]) -> dict[str, str]:
    """Name -> installed version of every distribution `roots` need at run time."""
    env: dict[str, str] = {k: str(v) for k, v in default_environment().items()}
    versions: dict[str, str] = {}
    extras_seen: dict[str, set[str]] = {}
    pending: list[tuple[Requirement, set[str]]] = [(Requirement(r), set()) for r in roots]
    while pending:
        req, parent_extras = pending.pop()
        if not _applies(req, parent_extras, env):
            continue
        dist = md.distribution(req.name)
        name = canonicalize_name(dist.metadata["Name"])
        wanted = set(req.extras)
        if name in versions and wanted <= extras_seen[name]:
            continue
        versions[name] = dist.version.split("+", 1)[0]
        extras_seen.setdefault(name, set()).update(wanted)
        pending.extend((Requirement(dep), extras_seen[name]) for dep in dist.requires or [])
    return versions


def main() -> int:
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    sys.stdout.write(HEADER.format(py=py))
    for name, version in sorted(closure(root_requirements()).items()):
        if name not in LEFT_OUT:
            sys.stdout.write(f"{name}=={version}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

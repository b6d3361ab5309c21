"""The light splitserve-client distribution (clients/python): built into a wheel, installed into
a fresh venv with grpcio and protobuf only (no torch), its `splitserve` command streams from and
benchmarks a real stack."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.client import generate, text_request
from tests.e2e.stack import Stack

REPO = Path(__file__).resolve().parents[2]
LIGHT = REPO / "clients" / "python"
PROMPT = "The quick brown fox"


def _pyproject(path: Path) -> dict[str, Any]:
    return tomllib.loads(path.read_text())["project"]


def _pip(*args: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_light_package_tracks_the_server_package() -> None:
    light, server = _pyproject(LIGHT / "pyproject.toml"), _pyproject(REPO / "pyproject.toml")
    assert light["version"] == server["version"]
    assert set(light["dependencies"]) <= set(server["dependencies"])


@pytest.fixture(scope="module")
def light_splitserve(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `splitserve` script of a fresh venv holding the light wheel, grpcio and protobuf (the
    versions this interpreter runs, so pip's cache has them)."""
    wheels = tmp_path_factory.mktemp("light-wheel")
    shutil.rmtree(LIGHT / "build", ignore_errors=True)  # no stale modules from an older build
    _pip("wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(LIGHT))
    venv = tmp_path_factory.mktemp("light-venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    wheel = next(wheels.glob("splitserve_client-*.whl"))
    pins = [f"grpcio=={version('grpcio')}", f"protobuf=={version('protobuf')}"]
    python = str(venv / "bin" / "python")
    _pip("--python", python, "install", "--quiet", "--only-binary=:all:", str(wheel), *pins)
    return venv / "bin" / "splitserve"


def _run(
    splitserve: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(splitserve), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=splitserve.parent,
        env={"PATH": os.environ["PATH"], **(env or {})},
    )


@pytest.mark.slow
def test_light_venv_has_no_torch(light_splitserve: Path) -> None:
    python = light_splitserve.parent / "python"
    absent = (
        "torch",
        "transformers",
        "splitserve",
        "frontend_svc",
        "splitserve_runtime.service_host",
    )
    probe = f"import importlib.util as u; print([m for m in {absent!r} if u.find_spec(m)])"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the venv alone
    result = subprocess.run(
        [str(python), "-c", probe],
        cwd=python.parent,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


@pytest.mark.slow
def test_light_generate_streams_what_the_grpc_client_gets(
    light_splitserve: Path, stack: Stack
) -> None:
    flags = ["--max-tokens", "16", "--temperature", "0", "--ignore-eos"]
    result = _run(
        light_splitserve, "generate", PROMPT, *flags, env={"SPLITSERVE_ADDR": stack.frontend}
    )
    assert result.returncode == 0, result.stderr
    expected = generate(
        stack.frontend, text_request(PROMPT, temperature=0.0, max_tokens=16, ignore_eos=True)
    )[0]
    assert expected.text and result.stdout == expected.text + "\n"


@pytest.mark.slow
def test_light_bench_serve_completes_every_request(light_splitserve: Path, stack: Stack) -> None:
    result = _run(
        light_splitserve,
        "bench",
        "serve",
        "--addr",
        stack.frontend,
        "--num-prompts",
        "4",
        "--input-len",
        "16",
        "--output-len",
        "8",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert (summary["completed"], summary["failed"], summary["total_output_tokens"]) == (4, 0, 32)


@pytest.mark.slow
def test_light_splitserve_refuses_server_commands(light_splitserve: Path) -> None:
    result = _run(light_splitserve, "up")
    assert result.returncode == 2
    assert "needs the full splitserve package" in result.stderr

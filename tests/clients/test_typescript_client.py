"""The TypeScript client (clients/typescript): generated with buf's local protoc-gen-es, compiled
with tsc, and run with Node against a real stack; it must stream what the Python client gets."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from splitserve_contracts.common.v1 import types_pb2
from tests.e2e.client import generate, text_request
from tests.e2e.stack import Stack

CLIENT = Path(__file__).resolve().parents[2] / "clients" / "typescript"
NODE, NPM = shutil.which("node"), shutil.which("npm")
PROMPT = "The quick brown fox"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        NODE is None or NPM is None,
        reason="node and npm are not on PATH (Debian: apt-get install nodejs npm; .ci/run does)",
    ),
]


def _run(*command: str, timeout: float) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command, cwd=CLIENT, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(command)}:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def compiled_client() -> Path:
    """`npm ci` when node_modules is missing or older than the lock file, then buf + tsc."""
    assert NPM is not None
    installed = CLIENT / "node_modules" / ".package-lock.json"
    lock = CLIENT / "package-lock.json"
    if not installed.exists() or installed.stat().st_mtime < lock.stat().st_mtime:
        _run(NPM, "ci", "--no-audit", "--no-fund", timeout=600)
    _run(NPM, "run", "build", timeout=180)
    return CLIENT / "dist" / "generate.js"


def test_compiled_typescript_client_streams_the_python_clients_tokens(
    compiled_client: Path, stack: Stack
) -> None:
    assert NODE is not None
    flags = ["--max-tokens", "24", "--temperature", "0", "--ignore-eos"]
    result = _run(
        NODE,
        str(compiled_client),
        PROMPT,
        "--addr",
        stack.frontend,
        *flags,
        "--summary",
        timeout=120,
    )
    summary = json.loads(result.stderr.strip().splitlines()[-1])
    python = generate(
        stack.frontend, text_request(PROMPT, temperature=0.0, max_tokens=24, ignore_eos=True)
    )[0]
    assert python.text and len(python.token_ids) == 24
    assert summary["token_ids"] == python.token_ids
    assert summary["finish_reason"] == types_pb2.FinishReason.Name(
        python.finish_reason
    ).removeprefix("FINISH_REASON_")
    assert result.stdout == python.text + "\n"


def test_typescript_client_reports_a_bad_request(compiled_client: Path, stack: Stack) -> None:
    assert NODE is not None
    result = subprocess.run(
        [NODE, str(compiled_client), PROMPT, "--addr", stack.frontend, "--temperature=-1"],
        cwd=CLIENT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "InvalidArgument: temperature must be finite and >= 0" in result.stderr

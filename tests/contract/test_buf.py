"""The buf gates: lint (STANDARD + COMMENTS) and breaking (FILE) against the committed baseline."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PROTOS = Path(__file__).resolve().parents[2] / "protos"
BUF = shutil.which("buf", path=str(Path(sys.executable).parent)) or shutil.which("buf")
pytestmark = pytest.mark.skipif(BUF is None, reason="buf (PyPI buf-bin) is not installed")


def buf(*args: str, cwd: Path = PROTOS) -> subprocess.CompletedProcess[str]:
    assert BUF is not None
    return subprocess.run([BUF, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_lint_passes() -> None:
    result = buf("lint")
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_breaking_change_against_baseline() -> None:
    result = buf("breaking", "--against", "baseline.binpb")
    assert result.returncode == 0, result.stdout + result.stderr


def _copy_protos(tmp_path: Path) -> Path:
    target = tmp_path / "protos"
    shutil.copytree(PROTOS, target)
    return target


def test_breaking_catches_a_renumbered_field(tmp_path: Path) -> None:
    copy = _copy_protos(tmp_path)
    proto = copy / "splitserve/core/v1/core_service.proto"
    text = proto.read_text()
    assert "uint64 request_handle = 2;" in text
    proto.write_text(text.replace("uint64 request_handle = 2;", "uint64 request_handle = 99;", 1))
    result = buf("breaking", "--against", str(PROTOS / "baseline.binpb"), cwd=copy)
    assert result.returncode != 0
    assert "request_handle" in result.stdout + result.stderr


def test_lint_catches_a_missing_comment(tmp_path: Path) -> None:
    copy = _copy_protos(tmp_path)
    proto = copy / "splitserve/common/v1/types.proto"
    text = proto.read_text()
    comment = "  // Keep generating after the end-of-sequence token.\n"
    assert comment in text
    proto.write_text(text.replace(comment, "", 1))
    result = buf("lint", cwd=copy)
    assert result.returncode != 0
    assert "ignore_eos" in result.stdout + result.stderr

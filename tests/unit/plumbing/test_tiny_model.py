"""The tiny model (`--model tiny`) is built deterministically, once."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from splitserve_runtime.tiny_model import TINY_MODEL_DIRNAME, ensure_tiny_model


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_two_builds_are_identical(tmp_path: Path, tiny_model_dir: Path) -> None:
    again = ensure_tiny_model({"SPLITSERVE_CACHE_DIR": str(tmp_path)})
    assert again == tmp_path / TINY_MODEL_DIRNAME
    assert digest(again) == digest(tiny_model_dir)


def test_built_once_and_reused(tiny_model_dir: Path) -> None:
    stamp = (tiny_model_dir / "model.safetensors").stat().st_mtime_ns
    env = {"SPLITSERVE_CACHE_DIR": str(tiny_model_dir.parent)}
    assert ensure_tiny_model(env) == tiny_model_dir
    assert (tiny_model_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_it_is_a_llama_with_a_chat_template(tiny_model_dir: Path) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (tiny_model_dir / "chat_template.jinja").exists()

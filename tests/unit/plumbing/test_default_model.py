"""The embedded default model is built deterministically, once."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from splitserve_runtime.default_model import DEFAULT_MODEL_DIRNAME, ensure_default_model


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_two_builds_are_identical(tmp_path: Path, default_model_dir: Path) -> None:
    again = ensure_default_model({"SPLITSERVE_CACHE_DIR": str(tmp_path)})
    assert again == tmp_path / DEFAULT_MODEL_DIRNAME
    assert digest(again) == digest(default_model_dir)


def test_built_once_and_reused(default_model_dir: Path) -> None:
    stamp = (default_model_dir / "model.safetensors").stat().st_mtime_ns
    env = {"SPLITSERVE_CACHE_DIR": str(default_model_dir.parent)}
    assert ensure_default_model(env) == default_model_dir
    assert (default_model_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_it_is_a_llama_with_a_chat_template(default_model_dir: Path) -> None:
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (default_model_dir / "chat_template.jinja").exists()

"""Fixtures shared by the whole suite."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from tests.e2e.stack import Stack

pytest_plugins = ["tests.fixtures.cpu_kernels"]
"""Fixtures defined in tests/fixtures for more than one folder of tests."""

# Property tests draw the same examples on every run (`make test` must not fail by chance);
# HYPOTHESIS_PROFILE=explore draws new ones, to hunt for cases worth keeping.
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random model (`--model tiny`), built once per test session in a private cache.
    Fast tests serve it; the default model (SmolLM2) has its own slow tests."""
    from splitserve_runtime.tiny_model import ensure_tiny_model

    cache = tmp_path_factory.mktemp("splitserve-cache")
    return ensure_tiny_model({"SPLITSERVE_CACHE_DIR": str(cache)})


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path) -> Any:
    from frontend_svc.inputs.input_processor import load_tokenizer

    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture(scope="session")
def stack(tiny_model_dir: Path) -> Iterator[Stack]:
    """A TP=1 stack (worker, core, frontend processes) serving the tiny model."""
    running = Stack(tiny_model_dir).start()
    yield running
    running.stop()


@pytest.fixture(scope="session")
def llava_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random LLaVA-1.5-style checkpoint (tests/fixtures/llava_checkpoint.py), built
    once per test session."""
    from tests.fixtures.llava_checkpoint import make_llava_checkpoint

    return make_llava_checkpoint(tmp_path_factory.mktemp("llava") / "tiny-llava")


@pytest.fixture(scope="session")
def qwen2_5_vl_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2.5-VL checkpoint (tests/fixtures/qwen2_5_vl_checkpoint.py), built
    once per test session."""
    from tests.fixtures.qwen2_5_vl_checkpoint import make_qwen2_5_vl_checkpoint

    return make_qwen2_5_vl_checkpoint(tmp_path_factory.mktemp("qwen2_5_vl") / "tiny-qwen2_5_vl")


@pytest.fixture(scope="session")
def tool_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a Qwen3-style tokenizer and chat template (tools, <tool_call>,
    <think>): tests/fixtures/tool_model.py."""
    from tests.fixtures.tool_model import make_tool_model

    return make_tool_model(tmp_path_factory.mktemp("tool-model") / "tiny-tools", tiny_model_dir)

"""Fixtures shared by the whole suite."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.stack import Stack


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default model, built once per test session in a private cache."""
    from splitserve_runtime.default_model import ensure_default_model

    cache = tmp_path_factory.mktemp("splitserve-cache")
    return ensure_default_model({"SPLITSERVE_CACHE_DIR": str(cache)})


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: Path) -> Any:
    from frontend_svc.input_processor import load_tokenizer

    return load_tokenizer(str(default_model_dir))


@pytest.fixture(scope="session")
def stack(default_model_dir: Path) -> Iterator[Stack]:
    """A TP=1 stack (worker, core, frontend processes) serving the default model."""
    running = Stack(default_model_dir).start()
    yield running
    running.stop()

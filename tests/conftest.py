"""Fixtures shared by the whole suite."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default model, built once per test session in a private cache."""
    from splitserve.default_model import ensure_default_model

    cache = tmp_path_factory.mktemp("splitserve-cache")
    return ensure_default_model({"SPLITSERVE_CACHE_DIR": str(cache)})


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: Path) -> Any:
    from frontend_svc.input_processor import load_tokenizer

    return load_tokenizer(str(default_model_dir))

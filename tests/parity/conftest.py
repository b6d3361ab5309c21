"""Session-wide tiny checkpoints and their transformers reference models."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fixtures.checkpoints import CheckpointCache, load_reference
from tests.fixtures.ranks import SpawnedRanks


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> CheckpointCache:
    torch.set_num_threads(2)
    return CheckpointCache(tmp_path_factory.mktemp("worker-checkpoints"))


@pytest.fixture(scope="session")
def references(checkpoints: CheckpointCache) -> dict[Path, Any]:
    """transformers models by checkpoint folder, loaded once (use `reference(...)`)."""
    return {}


def reference_for(references: dict[Path, Any], path: Path) -> Any:
    if path not in references:
        references[path] = load_reference(path)
    return references[path]


@pytest.fixture(scope="module")
def group() -> Iterator[SpawnedRanks]:
    """Two spawned ranks (gloo) for a module's TP=2 / PP=2 cases (a module may have its own)."""
    ranks = SpawnedRanks(world_size=2)
    try:
        yield ranks
    finally:
        ranks.close()

"""Tiny checkpoints shared by the worker unit tests (built once per session)."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.checkpoints import CheckpointCache


@pytest.fixture(scope="session")
def worker_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> CheckpointCache:
    torch.set_num_threads(2)
    return CheckpointCache(tmp_path_factory.mktemp("worker-unit-checkpoints"))

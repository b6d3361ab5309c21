"""Fixtures for end-to-end tests (the `stack` fixture itself is in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.gateway_stack import Engine, start_engines


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir: Path) -> object:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def gateway_engines(tiny_model_dir: Path) -> Iterator[list[Engine]]:
    """Two engines with KV-cache events on (gRPC and ZMQ) and small KV caches, for the gateway
    contract and the gateway itself."""
    engines = start_engines(tiny_model_dir, 2)
    yield engines
    for engine in engines:
        engine.stack.stop()

"""A pooling engine's stack and its HTTP calls, shared by the pooling endpoints' end-to-end tests
(/classify, /pooling, /score, /rerank)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.stack import Stack

CORE_FLAGS = ["--max-num-batched-tokens", "16", "--max-model-len", "128"]
"""Prompts over 16 tokens are chunked."""


def pooling_stack(model_dir: Path) -> Iterator[Stack]:
    """The body of a module fixture: a stack on a *ForSequenceClassification (or bare) checkpoint,
    which --runner auto serves for pooling, stopped after the module's tests."""
    running = Stack(model_dir, core_flags=CORE_FLAGS).start()
    yield running
    running.stop()


def post(stack: Stack, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{stack.http}{path}", json=body, timeout=120)

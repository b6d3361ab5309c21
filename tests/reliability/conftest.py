"""Fixtures of the reliability suite: one stack per module, shared by its cases."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.stack import Stack


@pytest.fixture(scope="module")
def module_stack(tiny_model_dir: Path) -> Iterator[Stack]:
    """A TP=1 stack serving the tiny model, for this module's cases only (a case that broke it
    would fail the module, not the rest of the suite)."""
    stack = Stack(tiny_model_dir).start()
    yield stack
    stack.stop()

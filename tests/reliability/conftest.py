"""Fixtures of the reliability suite: one stack, shared by every bad-input and fuzzing case."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.stack import Stack


@pytest.fixture(scope="package")
def shared_stack(tiny_model_dir: Path) -> Iterator[Stack]:
    """A TP=1 stack serving the tiny model with default limits, for the bad-input and fuzzing
    cases of this package (started once: every case checks it still serves and is idle, so a
    case that broke it fails there, by name). The load tests start their own."""
    stack = Stack(tiny_model_dir).start()
    yield stack
    stack.stop()

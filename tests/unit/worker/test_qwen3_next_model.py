"""Qwen3NextForCausalLM on its own (no runner): the tiny checkpoint loaded through the model's
weight names, run over paged KV (full-attention layer) and state slots (DeltaNet layers) in
chunked steps, two requests sharing steps; every position's float32 logits against
transformers' forward over the whole sequence."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fixtures.hybrid_engine import HybridEngine, max_plan_diff, sequence
from tests.fixtures.qwen3_next_checkpoint import make_qwen3_next_checkpoint
from worker_svc.models.model_config import read_hf_config
from worker_svc.models.qwen3_next import Qwen3NextForCausalLM

TOLERANCE = 1e-4
BLOCKS_PER_REQUEST = 64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen3_next_checkpoint(tmp_path_factory.mktemp("qwen3_next"))


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(checkpoint), dtype=torch.float32
    ).eval()


def Engine(checkpoint: Path) -> HybridEngine:  # noqa: N802 (reads as the class it makes)
    return HybridEngine(Qwen3NextForCausalLM, checkpoint, BLOCKS_PER_REQUEST)


def test_state_specs_follow_the_layer_types(checkpoint: Path) -> None:
    specs = Engine(checkpoint).model.state_specs
    assert [spec is None for spec in specs] == [False, False, False, True]
    assert specs[0] is not None and specs[0].shapes == ((2 * 16 + 32, 3), (4, 8, 8))


def test_chunked_steps_match_transformers(checkpoint: Path, reference: Any) -> None:
    """Request 0: chunks 70, 1, 29 then decodes; request 1 prefills beside them."""
    engine = Engine(checkpoint)
    first, second = sequence(104, seed=1), sequence(75, seed=2)
    plan = [
        [(0, first[:70], 0)],
        [(0, first[70:71], 70), (1, second[:66], 0)],
        [(1, second[66:70], 66), (0, first[71:100], 71)],
        [(0, first[100:101], 100), (1, second[70:71], 70)],
        [(1, second[71:75], 71), (0, first[101:102], 101)],
        [(0, first[102:104], 102)],
    ]
    diffs = max_plan_diff(engine, reference, {0: first, 1: second}, plan)
    assert max(diffs.values()) < TOLERANCE, diffs


def test_refuses_unimplemented_features(checkpoint: Path) -> None:
    hf = read_hf_config(checkpoint)
    hf.attention_bias = True
    with pytest.raises(ValueError, match="attention_bias"):
        Qwen3NextForCausalLM.read_config(hf)

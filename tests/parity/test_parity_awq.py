"""AWQ (GEMM layout) checkpoints packed by AutoAWQ's own code (tests/fixtures/awq_checkpoints.py)
against transformers running the same weights as AutoAWQ's `dequantize_gemm` unpacks them
(transformers' own AWQ path needs AutoAWQ's CUDA kernels or IPEX, neither of which runs here):
float32 logits within 1e-4 and greedy tokens equal, at TP=1 and TP=2 (packed words, zero
points and scales split over the ranks)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fixtures.awq_checkpoints import make_awq_checkpoint
from tests.fixtures.checkpoints import CheckpointCache, load_reference
from tests.fixtures.parity import max_logit_diff, reference_generate, run_recording
from tests.fixtures.ranks import LocalRank, SpawnedRanks
from tests.fixtures.step_driver import StepDriver
from worker_svc.layers.quantized import WeightOnlyLinearMethod
from worker_svc.model_loader.model_load import LoadModelConfig

PROMPTS = [[5, 9, 33, 7, 100, 200, 3, 8, 9, 10, 11, 12, 13], [40, 41, 42]]
BLOCK_SIZE = 4
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def awq_case(
    checkpoints: CheckpointCache, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, Any]]:
    source = checkpoints.get("llama")
    path, weights = make_awq_checkpoint(source, tmp_path_factory.mktemp("awq") / "llama")
    reference = load_reference(source)
    state = reference.state_dict()
    with torch.no_grad():
        for key, weight in weights.items():
            state[key].copy_(weight)
    yield path, reference


def drive(ranks: Any, reference: Any) -> None:
    driver = StepDriver(BLOCK_SIZE, chunk_size=5)
    handles = [driver.add(p, max_tokens=5) for p in PROMPTS]
    assert max_logit_diff(driver, run_recording(driver, ranks), reference) < TOLERANCE
    for handle, prompt in zip(handles, PROMPTS, strict=True):
        assert driver.requests[handle].outputs == reference_generate(reference, prompt, 5)


def test_awq_matches_autoawq_dequantized(awq_case: tuple[Path, Any]) -> None:
    path, reference = awq_case
    rank = LocalRank()
    try:
        rank.load(LoadModelConfig.of(str(path), block_size=BLOCK_SIZE))
        rank.init(num_blocks=64)
        runner = rank.worker.runner
        assert runner is not None
        assert any(
            isinstance(getattr(m, "method", None), WeightOnlyLinearMethod)
            for m in runner.model.modules()
        )
        drive(rank, reference)
    finally:
        rank.close()


@pytest.mark.slow
def test_awq_at_tp2(awq_case: tuple[Path, Any]) -> None:
    path, reference = awq_case
    group = SpawnedRanks(world_size=2)
    try:
        group.load(LoadModelConfig.of(str(path), block_size=BLOCK_SIZE, tensor_parallel_size=2))
        group.init(num_blocks=64)
        drive(group, reference)
    finally:
        group.close()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": "gemv"}, "version 'gemv'"),
        ({"bits": 8}, "8-bit"),
        ({"zero_point": False}, "zero_point"),
    ],
)
def test_unsupported_awq_configs_are_refused(change: dict[str, Any], message: str) -> None:
    from worker_svc.quantization.awq import check_config

    with pytest.raises(ValueError) as err:
        check_config({"quant_method": "awq", "bits": 4, "group_size": 32, **change})
    assert message in str(err.value) and "'awq'" in str(err.value)

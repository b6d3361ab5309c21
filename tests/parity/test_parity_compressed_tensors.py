"""compressed-tensors checkpoints made by the `compressed-tensors` library's own compressors
(tests/fixtures/ct_checkpoints.py) against transformers loading the same checkpoint and
decompressing it with that library (`CompressedTensorsConfig(dequantize=True)`).

Weight-only schemes (W4A16 pack-quantized, symmetric and with zero points; W8A16) are exact
integer weights times their scales, so float32 logits stay within 1e-4 and greedy tokens equal
`generate`, at TP=1 and TP=2. W8A8 also quantizes activations per token (vLLM's absmax / 127),
which the decompressed reference does not: its logits are checked within a bound instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fixtures.checkpoints import CheckpointCache
from tests.fixtures.ct_checkpoints import make_ct_checkpoint
from tests.fixtures.parity import max_logit_diff, reference_generate, run_recording
from tests.fixtures.ranks import LocalRank, SpawnedRanks
from tests.fixtures.step_driver import StepDriver
from worker_svc.layers.quantized import W8A8LinearMethod, WeightOnlyLinearMethod
from worker_svc.model_loader.model_load import LoadModelConfig

PROMPTS = [[5, 9, 33, 7, 100, 200, 3, 8, 9, 10, 11, 12, 13], [40, 41, 42]]
BLOCK_SIZE = 4
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def ct_dirs(
    checkpoints: CheckpointCache, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ct")
    source = checkpoints.get("llama")
    names = ("w4a16-pack", "w4a16-pack-asym", "w8a16", "w8a8")
    return {name: make_ct_checkpoint(source, root / name, name) for name in names}


def decompressed(path: Path) -> Any:
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    return model.eval()


def loaded(path: Path) -> LocalRank:
    rank = LocalRank()
    rank.load(LoadModelConfig.of(str(path), block_size=BLOCK_SIZE))
    rank.init(num_blocks=64)
    return rank


def methods(rank: LocalRank) -> set[str]:
    runner = rank.worker.runner
    assert runner is not None
    return {type(getattr(m, "method", None)).__name__ for m in runner.model.modules()}


@pytest.mark.parametrize("name", ["w4a16-pack", "w4a16-pack-asym", "w8a16"])
def test_weight_only_matches_transformers(ct_dirs: dict[str, Path], name: str) -> None:
    reference = decompressed(ct_dirs[name])
    rank = loaded(ct_dirs[name])
    try:
        assert WeightOnlyLinearMethod.__name__ in methods(rank)
        driver = StepDriver(BLOCK_SIZE, chunk_size=5)
        handles = [driver.add(p, max_tokens=5) for p in PROMPTS]
        assert max_logit_diff(driver, run_recording(driver, rank), reference) < TOLERANCE
        for handle, prompt in zip(handles, PROMPTS, strict=True):
            assert driver.requests[handle].outputs == reference_generate(reference, prompt, 5)
    finally:
        rank.close()


def test_w8a8_runs_int8_activations(ct_dirs: dict[str, Path]) -> None:
    reference = decompressed(ct_dirs["w8a8"])
    rank = loaded(ct_dirs["w8a8"])
    try:
        assert W8A8LinearMethod.__name__ in methods(rank)
        driver = StepDriver(BLOCK_SIZE)
        driver.add(PROMPTS[0], max_tokens=1)
        ours = next(iter(run_recording(driver, rank).values()))
        theirs = reference(torch.tensor([PROMPTS[0]])).logits[0].detach()
        relative = float((ours - theirs).norm() / theirs.norm())
        assert 1e-6 < relative < 0.05, relative  # int8 activations: about 1 % per matmul
    finally:
        rank.close()


@pytest.mark.slow
def test_pack_quantized_with_zero_points_at_tp2(ct_dirs: dict[str, Path]) -> None:
    """Packed int32 words, group scales and packed zero points split over two ranks."""
    path = ct_dirs["w4a16-pack-asym"]
    reference = decompressed(path)
    group = SpawnedRanks(world_size=2)
    try:
        group.load(LoadModelConfig.of(str(path), block_size=BLOCK_SIZE, tensor_parallel_size=2))
        group.init(num_blocks=64)
        driver = StepDriver(BLOCK_SIZE, chunk_size=5)
        handles = [driver.add(p, max_tokens=5) for p in PROMPTS]
        assert max_logit_diff(driver, run_recording(driver, group), reference) < TOLERANCE
        for handle, prompt in zip(handles, PROMPTS, strict=True):
            assert driver.requests[handle].outputs == reference_generate(reference, prompt, 5)
    finally:
        group.close()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format": "float-quantized"}, "format 'float-quantized'"),
        (
            {
                "weights": {
                    "num_bits": 4,
                    "strategy": "group",
                    "group_size": 32,
                    "actorder": "group",
                }
            },
            "actorder 'group'",
        ),
        ({"weights": {"num_bits": 3, "strategy": "group", "group_size": 32}}, "int weights of 3"),
        (
            {"input_activations": {"num_bits": 8, "strategy": "tensor", "dynamic": False}},
            "dynamic per-token int8",
        ),
    ],
)
def test_unsupported_schemes_are_refused_in_one_line(change: dict[str, Any], message: str) -> None:
    from worker_svc.quantization.compressed_tensors import parse_scheme

    group: dict[str, Any] = {"weights": {"num_bits": 8, "strategy": "channel"}}
    config: dict[str, Any] = {"format": "pack-quantized", "config_groups": {"group_0": group}}
    if "format" in change:
        config["format"] = change["format"]
    else:
        group.update(change)
    with pytest.raises(ValueError) as err:
        parse_scheme(config)
    assert message in str(err.value) and "compressed-tensors" in str(err.value)

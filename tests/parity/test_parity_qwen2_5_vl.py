"""Qwen2.5-VL (windowed + full-attention vision blocks, patch merger, Qwen2 with M-RoPE),
float32, against transformers: logits of every computed position within 1e-4 and greedy tokens
equal to `generate`, for a prompt with two images of different sizes and text after them, a
text-only prompt beside it, whole and chunked prefills (chunks ending inside an image's
placeholders), at TP=1 and TP=2 (vision tower replicated). Also: a grid that does not fit its
pixel values is refused alone, with the reason."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fixtures.llava_checkpoint import png_bytes
from tests.fixtures.parity import reference_generate, reference_logits, run_recording
from tests.fixtures.qwen2_5_vl_checkpoint import (
    load_qwen2_5_vl_reference,
    qwen_prompt,
)
from tests.fixtures.ranks import LocalRank, SpawnedRanks
from tests.fixtures.step_driver import StepDriver
from worker_svc.model_loader.model_load import LoadModelConfig

TOLERANCE = 1e-4
BLOCK_SIZE = 4
MAX_TOKENS = 5
IMAGES = [png_bytes(1, (32, 24)), png_bytes(2, (40, 24))]


@pytest.fixture(scope="module")
def qwen_dir(qwen2_5_vl_model_dir: Path) -> Path:
    torch.set_num_threads(2)
    return qwen2_5_vl_model_dir


@pytest.fixture(scope="module")
def reference(qwen_dir: Path) -> Any:
    return load_qwen2_5_vl_reference(qwen_dir)


@pytest.fixture(scope="module")
def prompts(qwen_dir: Path) -> dict[str, tuple[list[int], list[Any], dict[str, Any]]]:
    return {
        "two": qwen_prompt(qwen_dir, "what differs between them", IMAGES),
        "text": qwen_prompt(qwen_dir, "no picture here, only words", []),
    }


@pytest.fixture
def rank(qwen_dir: Path) -> Iterator[LocalRank]:
    rank = LocalRank()
    rank.load(LoadModelConfig.of(str(qwen_dir), block_size=BLOCK_SIZE))
    rank.init(num_blocks=256)
    yield rank
    rank.close()


def full_inputs(inputs: dict[str, Any], length: int) -> dict[str, Any]:
    """The image inputs for `length` tokens (the generated ones are text)."""
    if not inputs:
        return {}
    types = inputs["mm_token_type_ids"]
    padded = torch.zeros(1, length, dtype=types.dtype)
    padded[:, : types.shape[1]] = types
    return {**inputs, "mm_token_type_ids": padded}


def check_against_reference(
    driver: StepDriver, logits: dict[int, torch.Tensor], reference: Any, inputs: dict[int, Any]
) -> float:
    """Every computed position's logits, then the greedy tokens, per request; the largest
    logit difference."""
    worst = 0.0
    for handle, got in logits.items():
        req = driver.requests[handle]
        ref = reference_logits(
            reference, req.tokens, **full_inputs(inputs[handle], len(req.tokens))
        )
        start = req.num_cached_prefix
        diff = float((got - ref[start : start + got.shape[0]]).abs().max())
        assert diff < TOLERANCE
        worst = max(worst, diff)
        assert req.outputs == reference_generate(
            reference, req.prompt, MAX_TOKENS, **inputs[handle]
        )
    return worst


def add_all(driver: StepDriver, prompts: dict[str, Any]) -> dict[int, Any]:
    inputs = {}
    for name in ("two", "text"):
        ids, features, reference_inputs = prompts[name]
        inputs[driver.add(ids, max_tokens=MAX_TOKENS, mm_features=features)] = reference_inputs
    return inputs


def test_prompt_positions_follow_transformers_get_rope_index(
    rank: LocalRank, reference: Any, prompts: dict[str, Any]
) -> None:
    ids, features, inputs = prompts["two"]
    runner = rank.worker.runner
    assert runner is not None
    model: Any = runner.model
    table, delta = model.mrope_positions(len(ids), [(f.offset, f.grid_thw) for f in features])
    expected, expected_delta = reference.model.get_rope_index(
        torch.tensor([ids]), inputs["mm_token_type_ids"], inputs["image_grid_thw"]
    )
    assert table.tolist() == expected[:, 0].tolist()
    assert delta == int(expected_delta) and delta < 0  # the images take fewer positions


@pytest.mark.parametrize("chunk_size", [1 << 30, 7])
def test_two_images_of_different_sizes_match_transformers(
    rank: LocalRank, reference: Any, prompts: dict[str, Any], chunk_size: int
) -> None:
    ids, features, _ = prompts["two"]
    if chunk_size == 7:  # a chunk boundary falls inside each image's placeholders
        assert all((f.offset // 7) != ((f.end - 1) // 7) for f in features)
    driver = StepDriver(BLOCK_SIZE, chunk_size=chunk_size)
    inputs = add_all(driver, prompts)
    logits = run_recording(driver, rank)
    worst = check_against_reference(driver, logits, reference, inputs)
    print(f"max |logit diff| at TP=1, chunk {chunk_size}: {worst:.2e}")
    runner = rank.worker.runner
    assert runner is not None and runner.encoder_runner is not None
    assert runner.encoder_runner.cache.num_encoded == 2
    assert runner.encoder_runner.num_on_demand == 0


def test_a_grid_that_does_not_fit_its_pixels_is_refused_alone(
    rank: LocalRank, prompts: dict[str, Any]
) -> None:
    ids, features, _ = prompts["two"]
    t, h, w = features[0].grid_thw
    forged = dataclasses.replace(features[0], grid_thw=(t, w, h + 2))
    driver = StepDriver(BLOCK_SIZE)
    bad = driver.add(ids, max_tokens=1, mm_features=[forged, features[1]])
    good = driver.add(ids, max_tokens=1, mm_features=features)
    output = rank.execute(driver.next_step())
    assert output is not None
    assert output.failed_req_handles == [bad]
    assert "do not fit grid_thw" in output.failed_reasons[0]
    assert output.req_handles == [good]


@pytest.mark.slow
def test_tensor_parallel_two_ranks_match_transformers(
    qwen_dir: Path, reference: Any, prompts: dict[str, Any]
) -> None:
    group = SpawnedRanks(world_size=2)
    try:
        group.load(LoadModelConfig.of(str(qwen_dir), tensor_parallel_size=2, block_size=BLOCK_SIZE))
        group.init(num_blocks=256)
        driver = StepDriver(BLOCK_SIZE, chunk_size=9)
        inputs = add_all(driver, prompts)
        logits = run_recording(driver, group)
        worst = check_against_reference(driver, logits, reference, inputs)
        print(f"max |logit diff| at TP=2, chunk 9: {worst:.2e}")
    finally:
        group.close()

"""LLaVA (CLIP vision tower + projector + Llama), float32, against transformers: logits of every
computed position within 1e-4 and greedy tokens equal to `generate`, with one and two images,
chunked prefills that end inside an image, at TP=1 and TP=2 (vision tower replicated on both
ranks). Also the rank's encoder cache: one encoder run per distinct image, entries dropped when
the core frees them and recomputed after a preemption, and a request whose image does not
match its hash refused alone."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.fixtures.llava_checkpoint import (
    llava_prompt,
    load_llava_reference,
    png_bytes,
)
from tests.fixtures.parity import reference_generate, reference_logits, run_recording
from tests.fixtures.ranks import LocalRank, SpawnedRanks
from tests.fixtures.step_driver import StepDriver
from worker_svc.model_loader.model_load import LoadModelConfig

TOLERANCE = 1e-4
BLOCK_SIZE = 4
MAX_TOKENS = 5
IMAGES = {"one": [png_bytes(1)], "two": [png_bytes(2), png_bytes(3, (64, 30))]}


@pytest.fixture(scope="module")
def llava_dir(llava_model_dir: Path) -> Path:
    torch.set_num_threads(2)
    return llava_model_dir


@pytest.fixture(scope="module")
def reference(llava_dir: Path) -> Any:
    return load_llava_reference(llava_dir)


@pytest.fixture(scope="module")
def prompts(llava_dir: Path) -> dict[str, tuple[list[int], list[Any], Any]]:
    out = {name: llava_prompt(llava_dir, "describe it", images) for name, images in IMAGES.items()}
    out["text"] = llava_prompt(llava_dir, "no picture here, only words", [])
    return out


@pytest.fixture
def rank(llava_dir: Path) -> Iterator[LocalRank]:
    rank = LocalRank()
    rank.load(LoadModelConfig.of(str(llava_dir), block_size=BLOCK_SIZE))
    rank.init(num_blocks=256)
    yield rank
    rank.close()


def check_against_reference(
    driver: StepDriver, logits: dict[int, torch.Tensor], reference: Any, pixels: dict[int, Any]
) -> None:
    """Every computed position's logits, then the greedy tokens, per request."""
    for handle, got in logits.items():
        req = driver.requests[handle]
        images = {} if pixels[handle] is None else {"pixel_values": pixels[handle]}
        ref = reference_logits(reference, req.tokens, **images)
        start = req.num_cached_prefix
        assert float((got - ref[start : start + got.shape[0]]).abs().max()) < TOLERANCE
        assert req.outputs == reference_generate(reference, req.prompt, MAX_TOKENS, **images)


def add_all(driver: StepDriver, prompts: dict[str, Any]) -> dict[int, Any]:
    pixels = {}
    for name in ("one", "two", "text"):
        ids, features, pixel_values = prompts[name]
        pixels[driver.add(ids, max_tokens=MAX_TOKENS, mm_features=features)] = pixel_values
    return pixels


@pytest.mark.parametrize("chunk_size", [1 << 30, 7])
def test_one_and_two_images_match_transformers(
    rank: LocalRank, reference: Any, prompts: dict[str, Any], chunk_size: int
) -> None:
    driver = StepDriver(BLOCK_SIZE, chunk_size=chunk_size)
    pixels = add_all(driver, prompts)
    logits = run_recording(driver, rank)
    check_against_reference(driver, logits, reference, pixels)
    runner = rank.worker.runner
    assert runner is not None and runner.encoder_runner is not None
    assert runner.encoder_runner.cache.num_encoded == 3  # one run per distinct image
    assert runner.encoder_runner.num_on_demand == 0


def test_same_image_is_encoded_once_and_freed_entries_are_recomputed_after_preemption(
    rank: LocalRank, reference: Any, prompts: dict[str, Any]
) -> None:
    ids, features, pixel_values = prompts["one"]
    driver = StepDriver(BLOCK_SIZE, chunk_size=6)
    first = driver.add(ids, max_tokens=MAX_TOKENS, mm_features=features)
    second = driver.add(ids, max_tokens=MAX_TOKENS, mm_features=features)
    runner = rank.worker.runner
    assert runner is not None and runner.encoder_runner is not None
    cache = runner.encoder_runner.cache
    end = features[0].end
    while driver.requests[second].num_computed < end:  # both prefills pass the image
        step = driver.next_step()
        output = rank.execute(step)
        assert output is not None
        driver.apply(output)
    assert cache.num_encoded == 1  # the shared entry is made once
    driver.preempt(second)  # the core frees the entry once no request needs it
    freed = dataclasses.replace(
        driver.next_step(), free_encoder_mm_hashes=(features[0].identifier,)
    )
    output = rank.execute(freed)
    assert output is not None and len(cache) == 0
    driver.apply(output)
    driver.resume(second)
    logits = run_recording(driver, rank)
    assert cache.num_encoded == 2  # the resumed request's recompute ran the encoder again
    pixels = {first: pixel_values, second: pixel_values}
    check_against_reference(driver, {second: logits[second]}, reference, pixels)


def test_an_image_that_does_not_match_its_hash_is_refused_alone(
    rank: LocalRank, prompts: dict[str, Any]
) -> None:
    ids, features, _ = prompts["one"]
    forged = dataclasses.replace(features[0], data=bytes(len(features[0].data)))
    driver = StepDriver(BLOCK_SIZE)
    bad = driver.add(ids, max_tokens=1, mm_features=[forged])
    good = driver.add(ids, max_tokens=1, mm_features=features)
    output = rank.execute(driver.next_step())
    assert output is not None
    assert output.failed_req_handles == [bad]
    assert "not the hash of its data" in output.failed_reasons[0]
    assert output.req_handles == [good]


@pytest.mark.slow
def test_tensor_parallel_two_ranks_match_transformers(
    llava_dir: Path, reference: Any, prompts: dict[str, Any]
) -> None:
    group = SpawnedRanks(world_size=2)
    try:
        loaded = group.load(
            LoadModelConfig.of(str(llava_dir), tensor_parallel_size=2, block_size=BLOCK_SIZE)
        )
        assert [m.max_tokens_per_mm_item for m in loaded] == [16, 16]
        group.init(num_blocks=256)
        driver = StepDriver(BLOCK_SIZE, chunk_size=9)
        pixels = add_all(driver, prompts)
        logits = run_recording(driver, group)
        check_against_reference(driver, logits, reference, pixels)
        assert np.all([len(r.outputs) == MAX_TOKENS for r in driver.requests.values()])
    finally:
        group.close()

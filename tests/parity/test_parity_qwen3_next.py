"""Qwen3-Next (gated DeltaNet state layers beside gated attention, experts with a shared expert)
through the ModelRunner, one rank, float32, against transformers: every computed position's
logits within 1e-4 and greedy tokens equal to `generate`, over chunked prefills (chunks longer
and shorter than the delta rule's 64-token chunks) with decodes of several requests sharing
steps, each on its own state slot; at TP=2 (gloo) each rank holds whole key-head groups of
every DeltaNet layer and half the attention heads and expert rows. No prefix caching: a state layer cannot resume mid-prompt
from cached KV alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.parity import max_logit_diff, reference_generate, run_recording
from tests.fixtures.qwen3_next_checkpoint import make_qwen3_next_checkpoint
from tests.fixtures.ranks import LocalRank, SpawnedRanks
from tests.fixtures.step_driver import StepDriver
from worker_svc.model_loader.model_load import LoadModelConfig

TOLERANCE = 1e-4
BLOCK_SIZE = 4
NUM_STATE_SLOTS = 5
LONG = [(7 * i + 3) % 500 + 3 for i in range(100)]
PROMPTS = [LONG, [40, 41, 42], [(13 * i + 5) % 500 + 3 for i in range(30)], [9]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen3_next_checkpoint(tmp_path_factory.mktemp("qwen3_next"))


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> Any:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    return model.eval()


@pytest.fixture
def rank(checkpoint: Path) -> Iterator[LocalRank]:
    rank = LocalRank()
    rank.load(LoadModelConfig.of(str(checkpoint), block_size=BLOCK_SIZE))
    rank.init(num_blocks=128, num_state_slots=NUM_STATE_SLOTS)
    yield rank
    rank.close()


@pytest.mark.parametrize("chunk_size", [1 << 30, 70, 17], ids=["whole", "chunks-70", "chunks-17"])
def test_chunked_prefill_and_decode_match(rank: LocalRank, reference: Any, chunk_size: int) -> None:
    driver = StepDriver(BLOCK_SIZE, chunk_size=chunk_size, num_state_slots=NUM_STATE_SLOTS)
    handles = [driver.add(p, max_tokens=6) for p in PROMPTS]
    logits = run_recording(driver, rank)
    assert max_logit_diff(driver, logits, reference) < TOLERANCE
    for handle, prompt in zip(handles, PROMPTS, strict=True):
        assert driver.requests[handle].outputs == reference_generate(reference, prompt, 6)


def test_a_finished_requests_slot_serves_the_next_request(rank: LocalRank, reference: Any) -> None:
    """Two slots for three requests in turn: a reused slot starts from a zero state."""
    driver = StepDriver(BLOCK_SIZE, chunk_size=40, num_state_slots=2)
    outputs = []
    for prompt in (PROMPTS[2], LONG, PROMPTS[1]):
        handle = driver.add(prompt, max_tokens=4)
        logits = run_recording(driver, rank)
        assert max_logit_diff(driver, {handle: logits[handle]}, reference) < TOLERANCE
        outputs.append(driver.requests[handle].outputs == reference_generate(reference, prompt, 4))
    assert all(outputs)


@pytest.mark.slow
def test_two_tensor_parallel_ranks_match(
    group: SpawnedRanks, checkpoint: Path, reference: Any
) -> None:
    group.load(LoadModelConfig.of(str(checkpoint), tensor_parallel_size=2, block_size=BLOCK_SIZE))
    try:
        group.init(num_blocks=128)
        driver = StepDriver(BLOCK_SIZE, chunk_size=40, num_state_slots=NUM_STATE_SLOTS)
        handles = [driver.add(p, max_tokens=4) for p in PROMPTS]
        assert max_logit_diff(driver, run_recording(driver, group), reference) < TOLERANCE
        for handle, prompt in zip(handles, PROMPTS, strict=True):
            assert driver.requests[handle].outputs == reference_generate(reference, prompt, 4)
    finally:
        group.shutdown_model()

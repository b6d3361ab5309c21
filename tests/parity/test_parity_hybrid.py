"""One rank, float32: GraniteMoeHybrid (Granite 4.0-H: Mamba2 layers beside attention layers)
through the engine's ModelRunner against transformers. Every computed position's logits must
match within 1e-4 and greedy tokens must equal `generate`, over a chunked prefill (chunks of 5
and 3 straddling the SSD chunk of 8 and the KV blocks) with decodes; no prefix caching (a
state layer's state cannot be shared). Over gloo at TP=2 (each rank half the Mamba2 heads;
B and C split by group, or replicated with one group and the gated norm's squares summed over
the ranks) and at PP=2 (the state layers on both stages)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.checkpoints import load_reference
from tests.fixtures.hybrid_checkpoints import VARIANTS, make_hybrid_checkpoint
from tests.fixtures.parity import max_logit_diff, reference_generate, run_recording
from tests.fixtures.ranks import LocalRank, SpawnedRanks
from tests.fixtures.step_driver import StepDriver
from worker_svc.model_loader.model_load import LoadModelConfig

PROMPTS = [
    [5, 9, 33, 7, 100, 200, 3, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19],
    [40, 41, 42],
    [300, 301, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 91, 92, 93, 94, 95],
]
TOLERANCE = 1e-4
BLOCK_SIZE = 4
NUM_STATE_SLOTS = 8


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hybrid_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> Any:
    return load_reference(checkpoint)


@pytest.fixture
def rank(checkpoint: Path) -> Iterator[LocalRank]:
    rank = LocalRank()
    rank.load(LoadModelConfig.of(str(checkpoint), block_size=BLOCK_SIZE))
    rank.init(num_blocks=128, num_state_slots=NUM_STATE_SLOTS)
    yield rank
    rank.close()


@pytest.mark.parametrize("chunk_size", [5, 3])
def test_chunked_prefill_and_decode_match(rank: LocalRank, reference: Any, chunk_size: int) -> None:
    driver = StepDriver(BLOCK_SIZE, chunk_size=chunk_size, num_state_slots=NUM_STATE_SLOTS)
    handles = [driver.add(p, max_tokens=6) for p in PROMPTS]
    logits = run_recording(driver, rank)
    assert max_logit_diff(driver, logits, reference) < TOLERANCE
    for handle, prompt in zip(handles, PROMPTS, strict=True):
        assert driver.requests[handle].outputs == reference_generate(reference, prompt, 6)


def test_whole_prompts_then_new_requests_in_freed_slots(rank: LocalRank, reference: Any) -> None:
    """Requests that finish give their slots back; later requests take them zeroed."""
    driver = StepDriver(BLOCK_SIZE, num_state_slots=NUM_STATE_SLOTS)
    for round_ in range(2):
        handles = [driver.add(p[round_:], max_tokens=3) for p in PROMPTS]
        logits = run_recording(driver, rank)
        assert max_logit_diff(driver, logits, reference) < TOLERANCE
        for handle, prompt in zip(handles, PROMPTS, strict=True):
            want = reference_generate(reference, prompt[round_:], 3)
            assert driver.requests[handle].outputs == want


@pytest.mark.slow
@pytest.mark.parametrize("layout", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_two_rank_parity(
    group: SpawnedRanks,
    checkpoint: Path,
    reference: Any,
    layout: tuple[int, int],
) -> None:
    tp, pp = layout
    group.load(
        LoadModelConfig.of(
            str(checkpoint),
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            block_size=BLOCK_SIZE,
        )
    )
    try:
        group.init(num_blocks=128)
        driver = StepDriver(BLOCK_SIZE, chunk_size=5, num_state_slots=NUM_STATE_SLOTS)
        handles = [driver.add(p, max_tokens=6) for p in PROMPTS]
        assert max_logit_diff(driver, run_recording(driver, group), reference) < TOLERANCE
        for handle, prompt in zip(handles, PROMPTS, strict=True):
            assert driver.requests[handle].outputs == reference_generate(reference, prompt, 6)
    finally:
        group.shutdown_model()

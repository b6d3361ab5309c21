"""Ranks over gloo: tensor parallelism (TP=2), pipeline parallelism (PP=2), and both (2 x 2).

Each rank is its own spawned process with its own Worker and receives identical steps; only
the output rank (first TP rank of the last stage) answers. Logits of every computed position
(plain prefill, chunked prefill, decodes, a prefix-cache hit) must match transformers within
1e-4, and greedy tokens must equal `generate`. A checkpoint with a single KV head runs at TP=2
too: both ranks then hold (replicate) that head.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.checkpoints import CheckpointCache
from tests.fixtures.parity import max_logit_diff, reference_generate, run_recording
from tests.fixtures.ranks import SpawnedRanks
from tests.fixtures.step_driver import StepDriver
from tests.parity.conftest import reference_for
from worker_svc.model_loader.model_load import LoadModelConfig

pytestmark = pytest.mark.slow

PROMPTS = [
    [5, 9, 33, 7, 100, 200, 3, 8, 9, 10, 11, 12, 13],
    [40, 41, 42],
    [300, 301, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 91, 92],
]
TOLERANCE = 1e-4
BLOCK_SIZE = 4
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2)}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def ranks(request: pytest.FixtureRequest) -> Iterator[tuple[SpawnedRanks, tuple[int, int]]]:
    tp, pp = LAYOUTS[str(request.param)]
    group = SpawnedRanks(world_size=tp * pp)
    try:
        yield group, (tp, pp)
    finally:
        group.close()


def load_layout(group: SpawnedRanks, path: Path, tp: int, pp: int) -> list[Any]:
    config = LoadModelConfig.of(
        str(path), tensor_parallel_size=tp, pipeline_parallel_size=pp, block_size=BLOCK_SIZE
    )
    return group.load(config)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_two_rank_parity(
    ranks: tuple[SpawnedRanks, tuple[int, int]],
    family: str,
    checkpoints: CheckpointCache,
    references: dict[Path, Any],
) -> None:
    group, (tp, pp) = ranks
    path = checkpoints.get(family)
    reference = reference_for(references, path)
    loaded = load_layout(group, path, tp, pp)
    try:
        assert [m.num_kv_heads for m in loaded] == [2 // tp] * tp * pp
        assert [m.num_layers for m in loaded] == [2 // pp] * tp * pp
        group.init(num_blocks=128)

        plain = StepDriver(BLOCK_SIZE)
        for prompt in PROMPTS:
            plain.add(prompt, max_tokens=1)
        assert max_logit_diff(plain, run_recording(plain, group), reference) < TOLERANCE

        chunked = StepDriver(BLOCK_SIZE, chunk_size=5)
        chunked.next_handle = 200
        handles = [chunked.add(p, max_tokens=6) for p in PROMPTS]
        logits = run_recording(chunked, group)
        assert max_logit_diff(chunked, logits, reference) < TOLERANCE
        for handle, prompt in zip(handles, PROMPTS, strict=True):
            assert chunked.requests[handle].outputs == reference_generate(reference, prompt, 6)

        hit_prompt = PROMPTS[2][:12] + [9, 8, 7]
        hit = chunked.add(
            hit_prompt, max_tokens=4, share_prefix_with=handles[2], num_cached_tokens=12
        )
        hit_logits = run_recording(chunked, group)
        assert set(hit_logits) == {hit}
        assert max_logit_diff(chunked, hit_logits, reference) < TOLERANCE
        assert chunked.requests[hit].outputs == reference_generate(reference, hit_prompt, 4)
    finally:
        group.shutdown_model()


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: the replicated k/v biases too
def test_one_kv_head_is_replicated_across_tp_ranks(
    ranks: tuple[SpawnedRanks, tuple[int, int]],
    family: str,
    checkpoints: CheckpointCache,
    references: dict[Path, Any],
) -> None:
    group, (tp, pp) = ranks
    path = checkpoints.get(family, num_key_value_heads=1)
    reference = reference_for(references, path)
    loaded = load_layout(group, path, tp, pp)
    try:
        assert [m.num_kv_heads for m in loaded] == [1] * tp * pp
        group.init(num_blocks=128)
        driver = StepDriver(BLOCK_SIZE, chunk_size=5)
        handles = [driver.add(p, max_tokens=6) for p in PROMPTS]
        assert max_logit_diff(driver, run_recording(driver, group), reference) < TOLERANCE
        for handle, prompt in zip(handles, PROMPTS, strict=True):
            assert driver.requests[handle].outputs == reference_generate(reference, prompt, 6)
    finally:
        group.shutdown_model()

"""LoRA parity: each request's logits (every computed position, float32) and greedy tokens equal
transformers + peft with that request's adapter, in steps that mix four adapters and the base
model, at TP=1 and TP=2. The adapters differ in what they target, their rank, rsLoRA, and
per-module rank and alpha patterns, so each path through the slots is exercised; the base
model's rows must not get an adapter.

A second wave of requests brings two adapters the ranks never loaded, into slots the first
wave's adapters leave: the ranks read them at their first slot (as after a restart or a cache
eviction), and slots are reused.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.checkpoints import CheckpointCache
from tests.fixtures.lora_adapters import load_peft_reference, make_adapter
from tests.fixtures.parity import Ranks, reference_generate, reference_logits, run_recording
from tests.fixtures.ranks import LocalRank, SpawnedRanks
from tests.fixtures.step_driver import StepDriver
from worker_svc.model_loader.model_load import LoadModelConfig

PROMPTS = [
    [5, 9, 33, 7, 100, 200, 3, 8, 9, 10, 11, 12, 13],
    [40, 41, 42],
    [300, 301, 77, 78, 79, 80, 81, 82, 83, 84, 85],
    [5, 9, 33, 7, 100, 200, 3, 8, 9],
    [7, 7, 7, 8, 8, 8, 9, 9, 9, 10, 10],
]
TOLERANCE = 1e-4
BLOCK_SIZE = 4
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def lora_setup(
    checkpoints: CheckpointCache, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[int, Path]]:
    """The base checkpoint and adapters 1..6 of it, by the id the tests give them."""
    base = checkpoints.get("llama")
    root = tmp_path_factory.mktemp("lora-parity")
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    mlp = ("gate_proj", "up_proj", "down_proj")
    return base, {
        1: make_adapter(base, root / "all-r8", seed=1),
        2: make_adapter(base, root / "attention-r4", seed=2, rank=4, targets=attention),
        3: make_adapter(base, root / "mlp-rslora", seed=3, rank=16, targets=mlp, use_rslora=True),
        4: make_adapter(
            base,
            root / "patterns",
            seed=4,
            rank=8,
            rank_pattern={"v_proj": 2},
            alpha_pattern={"o_proj": 4.0},
        ),
        5: make_adapter(base, root / "qv-r2", seed=5, rank=2, targets=("q_proj", "v_proj")),
        6: make_adapter(base, root / "down-r16", seed=6, rank=16, targets=("down_proj",)),
    }


def _config(base: Path, tp: int) -> LoadModelConfig:
    return LoadModelConfig.of(
        str(base),
        tensor_parallel_size=tp,
        block_size=BLOCK_SIZE,
        max_loras=4,
        max_lora_rank=16,
        max_cpu_loras=4,
    )


def check_mixed_waves(ranks: Ranks, base: Path, adapters: dict[int, Path]) -> None:
    """Wave 1: the base model and adapters 1-4 in the same steps (chunked prefill, decodes);
    wave 2: adapters 5 and 6, new to the ranks, beside the base model again."""
    paths = {i: str(p) for i, p in adapters.items()}
    finished: list[int] = []
    for wave in ([0, 1, 2, 3, 4], [5, 0, 6]):
        driver = StepDriver(BLOCK_SIZE, chunk_size=5, lora_paths=paths)
        driver.next_handle = 1000 * (wave[0] + 1)
        driver.finished = finished  # the previous wave's, not sent to the ranks yet
        handles = {
            driver.add(prompt, max_tokens=MAX_TOKENS, lora_id=lora): lora
            for prompt, lora in zip(PROMPTS, wave, strict=False)
        }
        logits = run_recording(driver, ranks)
        for handle, lora in handles.items():
            reference = load_peft_reference(base, adapters.get(lora))
            request = driver.requests[handle]
            expected = reference_logits(reference, request.tokens)[: len(request.tokens) - 1]
            worst = float((logits[handle] - expected).abs().max())
            assert worst < TOLERANCE, f"adapter {lora}: logits differ by {worst}"
            assert request.outputs == reference_generate(reference, request.prompt, MAX_TOKENS)
        finished = driver.finished


def test_lora_mixed_step_parity_single_rank(lora_setup: tuple[Path, dict[int, Path]]) -> None:
    base, adapters = lora_setup
    rank = LocalRank()
    try:
        rank.load(_config(base, 1))
        rank.init(num_blocks=256)
        check_mixed_waves(rank, base, adapters)
    finally:
        rank.close()


@pytest.fixture(scope="module")
def two_ranks() -> Iterator[SpawnedRanks]:
    group = SpawnedRanks(world_size=2)
    try:
        yield group
    finally:
        group.close()


@pytest.mark.slow
def test_lora_mixed_step_parity_tp2(
    two_ranks: SpawnedRanks, lora_setup: tuple[Path, dict[int, Path]]
) -> None:
    """Each rank holds its shard of every adapter (A split for o/down, B for q/k/v/gate/up)."""
    base, adapters = lora_setup
    two_ranks.load(_config(base, 2))
    two_ranks.init(num_blocks=256)
    check_mixed_waves(two_ranks, base, adapters)

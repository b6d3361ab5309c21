"""Issue 17's families over gloo at TP=2 (and PP=2 for Gemma 3's mixed local/global stages and
Mixtral): every computed position's float32 logits within 1e-4 of transformers and greedy
tokens equal to `generate`, over a chunked prefill with decodes. Past the original context,
Phi-3's longrope long factors and dynamic NTK's rescaled base at TP=2 as well.

At TP=2 each rank holds half the attention heads, half of every expert's intermediate
dimension (Mixtral, Qwen3-MoE) and half of Phi-3's fused q/k/v and gate/up rows. With expert
parallelism ("ep2": TP=2 and enable_expert_parallel) each rank holds half of the experts, whole.
OLMo 2's q/k norms span every head: each rank holds its heads' rows of their weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.checkpoints import CheckpointCache
from tests.fixtures.parity import (
    max_logit_diff,
    reference_generate,
    reference_logits,
    run_recording,
)
from tests.fixtures.ranks import SpawnedRanks
from tests.fixtures.step_driver import StepDriver
from tests.parity.conftest import reference_for
from tests.parity.test_parity_families import (
    BLOCK_SIZE,
    LONG_PROMPT,
    MAX_MODEL_LEN,
    PROMPTS,
    TOLERANCE,
)
from worker_svc.model_loader.model_load import LoadModelConfig

pytestmark = pytest.mark.slow

CASES = [
    ("tp2", "mistral_window"),
    ("tp2", "gemma2"),
    ("tp2", "gemma3"),
    ("tp2", "phi3"),
    ("tp2", "mixtral"),
    ("tp2", "qwen3_moe"),
    ("tp2", "yarn_rope"),
    ("tp2", "dynamic_rope"),
    ("ep2", "mixtral"),
    ("ep2", "qwen3_moe"),
    ("pp2", "gemma3"),
    ("pp2", "mixtral"),
    ("pp2", "granite"),  # the embedding multiplier on one stage, the logits scaling on the other
    ("tp2", "smollm3"),
    ("tp2", "olmo2"),  # the q/k norms' squares summed over the ranks
    ("tp2", "olmo2_mqa"),  # ... with the one KV head on both ranks counted once
    ("tp2", "glm4"),
    ("pp2", "glm4"),
    ("tp2", "gpt_oss"),  # half of every expert, the down bias once; half the sinks
    ("ep2", "gpt_oss"),  # whole experts, each rank's biases
    ("pp2", "gpt_oss"),
    ("tp2", "deepseek_v2"),  # half the heads over the latent cache every rank holds
    ("tp2", "deepseek_v3"),
    ("ep2", "deepseek_v3"),
    ("pp2", "deepseek_v2_groups"),  # the dense layer on one stage, experts on both
]
# (tensor_parallel_size, pipeline_parallel_size, enable_expert_parallel)
LAYOUTS = {"tp2": (2, 1, False), "ep2": (2, 1, True), "pp2": (1, 2, False)}


@contextmanager
def serving(group: SpawnedRanks, path: Path, layout: str, max_model_len: int) -> Iterator[None]:
    tp, pp, enable_expert_parallel = LAYOUTS[layout]
    config = LoadModelConfig.of(
        str(path),
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        block_size=BLOCK_SIZE,
        max_model_len=max_model_len,
        enable_expert_parallel=enable_expert_parallel,
    )
    group.load(config)
    try:
        group.init(num_blocks=128)
        yield
    finally:
        group.shutdown_model()


@pytest.mark.parametrize(("layout", "family"), CASES)
def test_two_rank_parity(
    group: SpawnedRanks,
    layout: str,
    family: str,
    checkpoints: CheckpointCache,
    references: dict[Path, Any],
) -> None:
    path = checkpoints.get(family)
    reference = reference_for(references, path)
    with serving(group, path, layout, MAX_MODEL_LEN.get(family, 0)):
        driver = StepDriver(BLOCK_SIZE, chunk_size=5)
        handles = [driver.add(p, max_tokens=6) for p in PROMPTS]
        assert max_logit_diff(driver, run_recording(driver, group), reference) < TOLERANCE
        for handle, prompt in zip(handles, PROMPTS, strict=True):
            assert driver.requests[handle].outputs == reference_generate(reference, prompt, 6)


def test_longrope_long_factors_at_tp2(
    group: SpawnedRanks, checkpoints: CheckpointCache, references: dict[Path, Any]
) -> None:
    """max_model_len 64 > Phi-3's original 32: the long factors, on half the heads per rank."""
    path = checkpoints.get("phi3")
    reference = reference_for(references, path)
    with serving(group, path, "tp2", max_model_len=64):
        driver = StepDriver(BLOCK_SIZE, chunk_size=16)
        handle = driver.add(LONG_PROMPT, max_tokens=6)
        assert max_logit_diff(driver, run_recording(driver, group), reference) < TOLERANCE
        assert driver.requests[handle].outputs == reference_generate(reference, LONG_PROMPT, 6)


def test_dynamic_ntk_scaled_base_at_tp2(
    group: SpawnedRanks, checkpoints: CheckpointCache, references: dict[Path, Any]
) -> None:
    """max_model_len 40 > max_position_embeddings 32: the base scaled for 40 tokens, as
    transformers does for the 40-token prompt."""
    path = checkpoints.get("dynamic_rope")
    reference = reference_for(references, path)
    with serving(group, path, "tp2", max_model_len=len(LONG_PROMPT)):
        driver = StepDriver(BLOCK_SIZE, chunk_size=16)
        handle = driver.add(LONG_PROMPT, max_tokens=1)
        ours = run_recording(driver, group)[handle]
        theirs = reference_logits(reference, LONG_PROMPT)
        assert float((ours - theirs).abs().max()) < TOLERANCE

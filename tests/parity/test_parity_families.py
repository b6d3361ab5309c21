"""One rank, float32: issue 17's families and features against transformers.

Sliding windows (Mistral; Gemma's alternating local/global layers), Gemma 2 and 3 (soft caps,
(1 + w) norms, scaled embeddings, query_pre_attn_scalar, Gemma 3's local rope), Phi-3 (fused
checkpoint tensors, longrope, partial rotary), Mixtral and Qwen3-MoE, yarn and dynamic NTK rope;
Granite (issue 23: embedding, attention, residual and logits multipliers); issue 41's small
dense families: SmolLM3 (NoPE layers, the window on them), OLMo 2 (post-norms, q/k norms over
the whole projection), GLM-4 (sandwich norms, a GPT-J-style partial rotary, fused gate/up).
Every computed position's logits must match within 1e-4 and greedy tokens must equal
`generate`, over a chunked prefill (chunks straddling blocks and windows) with decodes and a
prefix-cache hit.
"""

from __future__ import annotations

from collections.abc import Iterator
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
from tests.fixtures.ranks import LocalRank
from tests.fixtures.step_driver import StepDriver
from tests.parity.conftest import reference_for
from worker_svc.model_loader.model_load import LoadModelConfig

FAMILIES = [
    "mistral_window",
    "gemma2",
    "gemma3",
    "phi3",
    "mixtral",
    "qwen3_moe",
    "yarn_rope",
    "dynamic_rope",
    "granite",
    "smollm3",
    "olmo2",
    "glm4",
    "gpt_oss",
    "deepseek_v2",
    "deepseek_v2_groups",
    "deepseek_v3",
]
PROMPTS = [
    [5, 9, 33, 7, 100, 200, 3, 8, 9, 10, 11, 12, 13],
    [40, 41, 42],
    [300, 301, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 91, 92, 93, 94],
]
LONG_PROMPT = [(7 * i + 3) % 500 for i in range(40)]
TOLERANCE = 1e-4
BLOCK_SIZE = 4
# Within the original context: longrope's short factors, dynamic NTK unscaled (as transformers
# for these lengths).
MAX_MODEL_LEN = {"phi3": 32, "dynamic_rope": 32}


def load_rank(path: Path, max_model_len: int = 0) -> LocalRank:
    rank = LocalRank()
    rank.load(LoadModelConfig.of(str(path), block_size=BLOCK_SIZE, max_model_len=max_model_len))
    rank.init(num_blocks=128)
    return rank


@pytest.fixture(params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def rank(checkpoints: CheckpointCache, family: str) -> Iterator[LocalRank]:
    rank = load_rank(checkpoints.get(family), MAX_MODEL_LEN.get(family, 0))
    yield rank
    rank.close()


@pytest.fixture
def reference(checkpoints: CheckpointCache, references: dict[Path, Any], family: str) -> Any:
    return reference_for(references, checkpoints.get(family))


def test_chunked_prefill_and_decode_match(rank: LocalRank, reference: Any) -> None:
    driver = StepDriver(BLOCK_SIZE, chunk_size=5)
    handles = [driver.add(p, max_tokens=6) for p in PROMPTS]
    logits = run_recording(driver, rank)
    assert max_logit_diff(driver, logits, reference) < TOLERANCE
    for handle, prompt in zip(handles, PROMPTS, strict=True):
        assert driver.requests[handle].outputs == reference_generate(reference, prompt, 6)


def test_prefix_cache_hit_matches(rank: LocalRank, reference: Any) -> None:
    driver = StepDriver(BLOCK_SIZE)
    donor = driver.add(PROMPTS[2], max_tokens=1)
    run_recording(driver, rank)
    shared = PROMPTS[2][:12] + [7, 7, 123]
    hit = driver.add(shared, max_tokens=4, share_prefix_with=donor, num_cached_tokens=12)
    logits = run_recording(driver, rank)
    assert set(logits) == {hit}
    assert max_logit_diff(driver, logits, reference) < TOLERANCE
    assert driver.requests[hit].outputs == reference_generate(reference, shared, 4)


def test_longrope_long_factors_beyond_the_original_context(
    checkpoints: CheckpointCache, references: dict[Path, Any]
) -> None:
    """max_model_len 64 > original 32: long factors, as transformers for sequences past 32."""
    path = checkpoints.get("phi3")
    reference = reference_for(references, path)
    rank = load_rank(path, max_model_len=64)
    try:
        driver = StepDriver(BLOCK_SIZE, chunk_size=16)
        handle = driver.add(LONG_PROMPT, max_tokens=6)
        assert max_logit_diff(driver, run_recording(driver, rank), reference) < TOLERANCE
        assert driver.requests[handle].outputs == reference_generate(reference, LONG_PROMPT, 6)
    finally:
        rank.close()


def test_dynamic_ntk_scales_for_the_served_length(
    checkpoints: CheckpointCache, references: dict[Path, Any]
) -> None:
    """max_model_len 40 > max_position_embeddings 32: the base scaled for 40 tokens, which is
    what transformers uses for a 40-token sequence."""
    path = checkpoints.get("dynamic_rope")
    reference = reference_for(references, path)
    rank = load_rank(path, max_model_len=len(LONG_PROMPT))
    try:
        driver = StepDriver(BLOCK_SIZE, chunk_size=16)
        handle = driver.add(LONG_PROMPT, max_tokens=1)
        ours = run_recording(driver, rank)[handle]
        theirs = reference_logits(reference, LONG_PROMPT)  # the prompt alone: 40 tokens
        assert float((ours - theirs).abs().max()) < TOLERANCE
    finally:
        rank.close()


def test_deepseek_v3_multi_token_prediction_weights_are_skipped(
    checkpoints: CheckpointCache, references: dict[Path, Any], tmp_path: Path
) -> None:
    """DeepSeek-V3 checkpoints carry their MTP layer as `model.layers.<num_hidden_layers>.*`
    (enorm, hnorm, eh_proj and a whole decoder layer): loaded past, the model unchanged."""
    import shutil

    from safetensors.torch import load_file, save_file

    source = checkpoints.get("deepseek_v3")
    path = tmp_path / "with-mtp"
    shutil.copytree(source, path)
    tensors = load_file(str(path / "model.safetensors"))
    last = {k: v for k, v in tensors.items() if k.startswith("model.layers.2.")}
    mtp = {k.replace("model.layers.2.", "model.layers.3."): v.clone() for k, v in last.items()}
    hidden = tensors["model.norm.weight"].shape[0]
    for norm in ("enorm", "hnorm"):
        mtp[f"model.layers.3.{norm}.weight"] = tensors["model.norm.weight"].clone()
    mtp["model.layers.3.eh_proj.weight"] = tensors["model.norm.weight"].new_zeros(
        hidden, 2 * hidden
    )
    save_file(tensors | mtp, str(path / "model.safetensors"), metadata={"format": "pt"})
    rank = load_rank(path)
    try:
        driver = StepDriver(BLOCK_SIZE, chunk_size=5)
        handle = driver.add(PROMPTS[0], max_tokens=4)
        reference = reference_for(references, source)
        assert max_logit_diff(driver, run_recording(driver, rank), reference) < TOLERANCE
        assert driver.requests[handle].outputs == reference_generate(reference, PROMPTS[0], 4)
    finally:
        rank.close()

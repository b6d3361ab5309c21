"""One rank in bfloat16 (the serving dtype on CPU) against transformers in float32.

Teacher-forced: each parity prompt, extended by transformers' own greedy continuation, is fed
whole (in chunks, so later chunks read their context back from the paged cache); our bf16
argmax must agree with transformers' float32 argmax on at least 95 % of the positions of all
prompts of all families together. (Per family the tiny random models have near-ties that bf16
rounding flips: transformers' own bf16 agrees with its float32 on 91-98 % per family here.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.fixtures.checkpoints import CheckpointCache
from tests.fixtures.parity import reference_generate, reference_logits, run_recording
from tests.fixtures.ranks import LocalRank
from tests.fixtures.step_driver import StepDriver
from tests.parity.conftest import reference_for
from tests.parity.test_parity_single_rank import BLOCK_SIZE, FAMILIES, PROMPTS
from worker_svc.model_loader.model_load import LoadModelConfig

MIN_AGREEMENT = 0.95
NUM_CONTINUED = 8


def test_bf16_top1_agrees_with_float32_transformers(
    checkpoints: CheckpointCache, references: dict[Path, Any]
) -> None:
    num_agree = num_positions = 0
    for family in FAMILIES:
        agree, positions = top1_agreement(checkpoints, references, family)
        num_agree += agree
        num_positions += positions
    assert num_positions == len(FAMILIES) * sum(len(p) + NUM_CONTINUED for p in PROMPTS)
    assert num_agree / num_positions >= MIN_AGREEMENT, f"{num_agree}/{num_positions} agree"


def top1_agreement(
    checkpoints: CheckpointCache, references: dict[Path, Any], family: str
) -> tuple[int, int]:
    """(positions where our bf16 argmax equals transformers' float32 one, positions)."""
    path = checkpoints.get(family)
    reference = reference_for(references, path)
    rank = LocalRank()
    rank.load(LoadModelConfig.of(str(path), dtype="bfloat16", block_size=BLOCK_SIZE))
    rank.init(num_blocks=256)
    try:
        driver = StepDriver(BLOCK_SIZE, chunk_size=9)
        sequences = {}
        for prompt in PROMPTS:
            tokens = prompt + reference_generate(reference, prompt, NUM_CONTINUED)
            sequences[driver.add(tokens, max_tokens=1)] = tokens
        logits = run_recording(driver, rank)
    finally:
        rank.close()
    num_agree = num_positions = 0
    for handle, tokens in sequences.items():
        ours = logits[handle].float().argmax(dim=-1)
        theirs = reference_logits(reference, tokens).argmax(dim=-1)
        assert ours.shape == theirs.shape == (len(tokens),)
        num_agree += int((ours == theirs).sum())
        num_positions += len(tokens)
    return num_agree, num_positions

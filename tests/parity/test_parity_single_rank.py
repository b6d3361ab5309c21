"""One rank, float32: our models' logits and greedy tokens against transformers.

Modes: (a) a plain prefill of a batch of prompts, (b) a chunked prefill (chunks straddling
block boundaries) followed by decode steps, (c) a prefix-cache hit that reuses another
request's full blocks. Every computed position's logits must match within 1e-4.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from splitserve_contracts.output_types import LogprobsTable
from splitserve_contracts.sampling_types import SamplerParams
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

FAMILIES = ["llama", "qwen2", "mistral", "qwen3", "llama3_rope"]
PROMPTS = [
    [5, 9, 33, 7, 100, 200, 3, 8, 9, 10, 11, 12, 13],
    [40, 41, 42],
    [300, 301, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 91, 92, 93, 94],
]
TOLERANCE = 1e-4
BLOCK_SIZE = 4


@pytest.fixture(params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def rank(checkpoints: CheckpointCache, family: str) -> Iterator[LocalRank]:
    rank = LocalRank()
    rank.load(LoadModelConfig.of(str(checkpoints.get(family)), block_size=BLOCK_SIZE))
    rank.init(num_blocks=256)
    yield rank
    rank.close()


@pytest.fixture
def reference(checkpoints: CheckpointCache, references: dict[Path, Any], family: str) -> Any:
    return reference_for(references, checkpoints.get(family))


def test_prefill_logits_match(rank: LocalRank, reference: Any) -> None:
    driver = StepDriver(BLOCK_SIZE)
    for prompt in PROMPTS:
        driver.add(prompt, max_tokens=1)
    logits = run_recording(driver, rank)
    assert len(driver.history) == 1  # the whole batch prefilled in one step
    assert max_logit_diff(driver, logits, reference) < TOLERANCE


def test_chunked_prefill_then_decode_logits_match(rank: LocalRank, reference: Any) -> None:
    driver = StepDriver(BLOCK_SIZE, chunk_size=5)
    for prompt in PROMPTS:
        driver.add(prompt, max_tokens=6)
    logits = run_recording(driver, rank)
    assert any(len(out.req_handles) < step.num_reqs for step, out in driver.history if out)
    assert max_logit_diff(driver, logits, reference) < TOLERANCE


def test_prefix_cache_hit_logits_match(rank: LocalRank, reference: Any) -> None:
    driver = StepDriver(BLOCK_SIZE)
    donor = driver.add(PROMPTS[2], max_tokens=1)
    run_recording(driver, rank)
    shared = PROMPTS[2][:12] + [7, 7, 123]
    hit = driver.add(shared, max_tokens=5, share_prefix_with=donor, num_cached_tokens=12)
    logits = run_recording(driver, rank)
    new_step = next(
        s
        for s, _ in driver.history
        if s.scheduled_new_reqs and s.scheduled_new_reqs[0].req_handle == hit
    )
    assert new_step.scheduled_new_reqs[0].num_computed_tokens == 12
    assert new_step.num_scheduled_tokens.tolist() == [3]
    assert set(logits) == {hit}
    assert max_logit_diff(driver, logits, reference) < TOLERANCE
    assert driver.requests[hit].outputs == reference_generate(reference, shared, 5)


def test_greedy_generation_matches_generate(rank: LocalRank, reference: Any) -> None:
    driver = StepDriver(BLOCK_SIZE, chunk_size=7)
    handles = [driver.add(p, max_tokens=8) for p in PROMPTS]
    outputs = driver.run(rank.execute)
    for handle, prompt in zip(handles, PROMPTS, strict=True):
        assert outputs[handle] == reference_generate(reference, prompt, 8)


def test_resumed_request_regenerates_identically(rank: LocalRank, reference: Any) -> None:
    driver = StepDriver(BLOCK_SIZE, chunk_size=6)
    handle = driver.add(PROMPTS[0], max_tokens=8)
    other = driver.add(PROMPTS[1], max_tokens=8)
    for _ in range(4):
        out = rank.execute(driver.next_step())
        assert out is not None
        driver.apply(out)
    driver.preempt(handle)
    for _ in range(2):  # the other request keeps decoding meanwhile
        out = rank.execute(driver.next_step())
        assert out is not None
        driver.apply(out)
    driver.resume(handle)
    outputs = driver.run(rank.execute)
    assert outputs[handle] == reference_generate(reference, PROMPTS[0], 8)
    assert outputs[other] == reference_generate(reference, PROMPTS[1], 8)


def test_seeded_sampling_reproduces_alone_and_in_a_batch(rank: LocalRank) -> None:
    seeded = SamplerParams(temperature=1.0, top_p=0.9, seed=42)
    driver = StepDriver(BLOCK_SIZE)  # one driver: finished requests are dropped on the way

    def sample(options: SamplerParams, extra: list[SamplerParams]) -> list[int]:
        handle = driver.add(PROMPTS[0], options, max_tokens=10)
        for i, opts in enumerate(extra):
            driver.add(PROMPTS[1 + i % 2], opts, max_tokens=10)
        return driver.run(rank.execute)[handle]

    alone = sample(seeded, [])
    assert sample(seeded, []) == alone
    crowd = [
        SamplerParams(temperature=1.0),
        SamplerParams(temperature=0.0),
        SamplerParams(temperature=0.7, seed=7, top_k=5),
    ]
    assert sample(seeded, crowd) == alone
    assert sample(SamplerParams(temperature=1.0, top_p=0.9, seed=43), []) != alone


def rows(table: LogprobsTable | None) -> SimpleNamespace:
    """A table's columns as arrays with one row per position."""
    assert table is not None
    width = table.num_top_logprobs + 1
    return SimpleNamespace(
        num_top_logprobs=table.num_top_logprobs,
        token_ids=np.array(table.token_ids).reshape(-1, width),
        logprobs=np.array(table.logprobs, np.float32).reshape(-1, width),
        ranks=np.array(table.ranks),
    )


@pytest.mark.parametrize("family", ["llama"])
def test_prompt_and_sample_logprobs_match(rank: LocalRank, reference: Any) -> None:
    prompt = PROMPTS[2]
    options = SamplerParams(temperature=0.0, logprobs=2, prompt_logprobs=3)
    driver = StepDriver(BLOCK_SIZE, chunk_size=6)
    handle = driver.add(prompt, options, max_tokens=3)
    driver.run(rank.execute)
    outputs = [out for _, out in driver.history]
    delivered = [e for out in outputs if out for e in out.prompt_logprobs if e.req_handle == handle]
    assert len(delivered) == 1  # once, when the chunked prefill completes
    assert outputs[3] is not None  # 4 chunks of <= 6: delivered with the fourth
    assert [e.req_handle for e in outputs[3].prompt_logprobs] == [handle]
    table = rows(delivered[0].table)
    tokens = driver.requests[handle].tokens
    ref = torch.log_softmax(reference_logits(reference, tokens), dim=-1)
    positions = torch.arange(len(prompt) - 1)
    chosen = torch.tensor(prompt[1:])
    assert table.num_top_logprobs == 3 and table.token_ids[:, 0].tolist() == prompt[1:]
    assert np.allclose(table.logprobs[:, 0], ref[positions, chosen].numpy(), atol=1e-4)
    assert table.token_ids[:, 1:].tolist() == ref[positions].topk(3).indices.tolist()
    ref_ranks = (ref[positions] >= ref[positions, chosen][:, None]).sum(-1)
    assert table.ranks.tolist() == ref_ranks.tolist()
    sampled = [rows(e.table) for out in outputs if out for e in out.logprobs]
    assert len(sampled) == 3
    for i, step_table in enumerate(sampled):
        pos = len(prompt) - 1 + i
        assert step_table.token_ids[0, 0] == tokens[pos + 1] and step_table.ranks[0] == 1
        assert abs(float(step_table.logprobs[0, 0]) - float(ref[pos, tokens[pos + 1]])) < 1e-4
        assert step_table.token_ids[0, 1:].tolist() == ref[pos].topk(2).indices.tolist()

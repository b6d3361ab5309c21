"""The rank's start-up warm-up (worker_svc/runner/warm_up.py; issue 37, item 4): InitializeKvCache runs
one dummy request through the whole step path (input batch, forward, sampler), lockstep or
async-scheduled, and leaves nothing behind: the batch is empty, the engine's generator is
untouched, and the first real request's greedy tokens are those of a rank that skipped it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fixtures.checkpoints import CheckpointCache
from tests.fixtures.ranks import LocalRank
from tests.fixtures.step_driver import StepDriver
from worker_svc.model_loader.model_load import LoadModelConfig
from worker_svc.runner.model_runner import ModelRunner
from worker_svc.runner.warm_up import WARM_UP_PROMPT_TOKENS, warm_up_steps
from worker_svc.sample.sampler import Sampler


@pytest.fixture(scope="module")
def base(worker_checkpoints: CheckpointCache) -> Path:
    return worker_checkpoints.get("llama")


def first_answer(
    base: Path, is_async: bool, sampled: list[int]
) -> tuple[list[int], int, list[int], torch.Tensor]:
    """(tokens per step the warm-up computed, its sampler calls, the first request's greedy
    tokens, the engine generator's state after both)."""
    rank = LocalRank()
    config = LoadModelConfig.of(str(base), block_size=4, async_scheduling=is_async)
    rank.load(config.with_options(max_model_len=128))
    runner = rank.worker.runner
    assert runner is not None
    computed: list[int] = []
    execute = runner.execute

    def counting(step: Any, *args: Any) -> Any:
        computed.append(step.total_num_scheduled_tokens)
        return execute(step, *args)

    runner.execute = counting  # type: ignore[method-assign]
    try:
        rank.init(num_blocks=32)
    finally:
        del runner.execute
    num_sampled = len(sampled)
    assert runner.batch is not None and runner.batch.num_reqs == 0
    driver = StepDriver(4)
    handle = driver.add([5, 6, 7, 8, 9, 10], max_tokens=6)
    tokens = driver.run(rank.execute)[handle]
    state = runner.sampler.generator.get_state()
    rank.close()
    return computed, num_sampled, tokens, state


@pytest.mark.parametrize("is_async", [False, True], ids=["lockstep", "async"])
def test_the_warm_up_runs_a_dummy_request_and_leaves_nothing_behind(
    base: Path, is_async: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    sampled: list[int] = []
    sample = Sampler.__call__

    def counting_sampler(self: Sampler, *args: Any, **kwargs: Any) -> Any:
        sampled.append(1)
        return sample(self, *args, **kwargs)

    monkeypatch.setattr(Sampler, "__call__", counting_sampler)
    computed, num_sampled, tokens, state = first_answer(base, is_async, sampled)
    assert computed == [WARM_UP_PROMPT_TOKENS, 1, 0]  # the prefill, a decode, the finish
    assert num_sampled == 2  # the prefill's token and the decode's
    monkeypatch.setattr(ModelRunner, "warm_up", lambda self: None)
    sampled.clear()
    skipped, num_cold_sampled, cold_tokens, cold_state = first_answer(base, is_async, sampled)
    assert (skipped, num_cold_sampled) == ([], 0) and tokens == cold_tokens
    assert torch.equal(state, cold_state)


def test_a_cache_too_small_for_the_warm_up_request_gets_none() -> None:
    assert warm_up_steps(block_size=4, num_blocks=3, is_async_scheduling=False) == []
    assert len(warm_up_steps(block_size=4, num_blocks=4, is_async_scheduling=False)) == 3

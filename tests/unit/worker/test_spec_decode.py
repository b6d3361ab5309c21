"""Speculative decoding on a rank without a model: n-gram proposals, the config's schedule, and
the rejection rule's output distribution (a statistical test: the tokens a request outputs
while verifying drafts are distributed as the target's probabilities, position by position)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from splitserve_contracts.engine_options_types import ModelOptions
from splitserve_contracts.sampling_types import SamplerParams
from splitserve_contracts.spec_decode import (
    InvalidSpeculativeConfig,
    SpeculativeConfig,
    parse_speculative_config,
    propose_ngram,
)
from tests.fixtures.step_driver import ids
from worker_svc.runner.input_batch import InputBatch
from worker_svc.runner.spec_decode import SpecDecoder, Verified
from worker_svc.sample.sampler import Sampler
from worker_svc.sample.sampling_metadata import SamplingStates
from worker_svc.scheduler_output import NewRequestData, SchedulerOutput

V = 8
BS = 4
PROMPT = [1, 2, 3, 4, 1, 2]
"""Its last n-gram "1 2" occurred at the start: the drafts are [3, 4]."""
DRAFTS = (3, 4)
TARGET = torch.tensor(
    [
        [0.05, 0.10, 0.15, 0.30, 0.05, 0.15, 0.10, 0.10],  # position 0: the draft 3 has 0.30
        [0.20, 0.05, 0.05, 0.10, 0.25, 0.05, 0.20, 0.10],  # position 1: the draft 4 has 0.25
        [0.10, 0.10, 0.30, 0.10, 0.10, 0.10, 0.10, 0.10],  # the bonus position
    ]
)
CHI2_CRITICAL_DF7 = 29.88
"""The chi-square statistic with 7 degrees of freedom exceeds this with probability 1e-4."""


def test_ngram_proposes_what_followed_the_longest_match() -> None:
    assert propose_ngram(PROMPT, 1, 3, 2, 64).tolist() == list(DRAFTS)
    assert propose_ngram([5, 6, 7, 5, 6, 7, 5], 2, 3, 4, 64).tolist() == [6, 7, 5]
    assert propose_ngram([1, 2, 3, 4], 1, 3, 2, 64).tolist() == []  # nothing repeats
    assert propose_ngram(PROMPT, 3, 3, 2, 64).tolist() == []  # no 3-gram match
    assert propose_ngram(PROMPT, 1, 3, 5, 7).tolist() == [3]  # capped by max_model_len


def test_config_follows_vllm_keys_and_schedule() -> None:
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert config is not None
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    lookup = config.num_spec_tokens_for_batch(16)
    assert lookup[1] == 3 and lookup[16] == 0  # off for large batches by default
    forced = SpeculativeConfig("ngram", 3, 1, 2, ((1, 4, 2), (5, 6, 0)))
    assert forced.num_spec_tokens_for_batch(8)[1:] == [2, 2, 2, 2, 0, 0, 0, 0]
    assert parse_speculative_config("") is None
    for bad in (
        '{"method": "eagle", "num_speculative_tokens": 3}',
        '{"method": "ngram"}',
        '{"method": "ngram", "num_speculative_tokens": 99}',
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
        '"prompt_lookup_max": 2}',
        '{"method": "ngram", "num_speculative_tokens": 2, "typo": 1}',
        "[1]",
    ):
        with pytest.raises(InvalidSpeculativeConfig):
            parse_speculative_config(bad)


def _speculative_step(num_reqs: int, sampler: Sampler) -> tuple[Verified, np.ndarray]:
    """num_reqs unseeded temperature-1 requests with PROMPT, each verifying its 2 drafts in one
    step whose logits rows are log(TARGET): what they keep, and the drafts proposed."""
    batch = InputBatch(
        max_model_len=64,
        block_size=BS,
        vocab_size=V,
        num_kv_blocks=4 * num_reqs + 1,
        capacity=num_reqs,
        sampling=SamplingStates(num_reqs, V, torch.device("cpu")),
    )
    spec = SpecDecoder(SpeculativeConfig("ngram", 2, 1, 3), max_model_len=64)
    new_reqs = [  # the prompt but its last token has KV: the step decodes that one
        NewRequestData(
            h,
            f"r{h}",
            ids(PROMPT),
            SamplerParams(temperature=1.0),
            ids([1 + 2 * h, 2 + 2 * h]),
            len(PROMPT) - 1,
        )  # fmt: skip
        for h in range(num_reqs)
    ]
    step = SchedulerOutput(
        step_id=1,
        scheduled_new_reqs=new_reqs,
        num_scheduled_tokens=ids([3] * num_reqs),
        total_num_scheduled_tokens=3 * num_reqs,
        num_spec_tokens=ids([2] * num_reqs),
    )
    plan = spec.propose(batch, batch.update_states(step))
    inputs = batch.prepare_inputs(plan)
    assert inputs.num_drafts is not None and (inputs.num_drafts == 2).all()
    drafts = inputs.input_ids.reshape(num_reqs, 3)[:, 1:]
    rows, num_tokens = spec.expand(batch, inputs)
    spec.save_generators(batch, inputs)
    metadata = batch.sampling.build(
        rows, batch.token_ids, batch.num_prompt_tokens[rows], num_tokens
    )
    logits = TARGET.log().repeat(num_reqs, 1)
    sampled = sampler(logits, metadata).sampled_token_ids.numpy().astype(np.int64)
    return spec.verify(batch, inputs, sampled), drafts


def chi2(counts: np.ndarray, probs: torch.Tensor) -> float:
    expected = probs.numpy() * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_rejection_keeps_the_target_distribution_at_every_position() -> None:
    """Position 0's output is the draft with p(draft) and otherwise drawn from the rest of p
    (vLLM's recovered token), so it is distributed as p; the next position's output, for the
    requests that accepted the first draft, as that position's p; and so on to the bonus."""
    num_reqs = 6000
    verified, drafts = _speculative_step(
        num_reqs, Sampler(torch.device("cpu"), ModelOptions(seed=7))
    )
    assert (drafts == DRAFTS).all()
    starts = np.concatenate([[0], np.cumsum(verified.num_sampled)[:-1]])
    first = verified.token_ids[starts]
    # Accepted runs are the drafts, then one drawn token.
    assert ((verified.num_sampled > 1) == (first == DRAFTS[0])).all()
    stats = [chi2(np.bincount(first, minlength=V), TARGET[0])]
    after_one = starts[verified.num_sampled >= 2] + 1
    stats.append(chi2(np.bincount(verified.token_ids[after_one], minlength=V), TARGET[1]))
    after_two = starts[verified.num_sampled == 3] + 2
    assert len(after_two) > 300
    stats.append(chi2(np.bincount(verified.token_ids[after_two], minlength=V), TARGET[2]))
    assert max(stats) < CHI2_CRITICAL_DF7, stats
    # The same statistic tells a biased rule apart: accepting the draft with probability
    # min(1, 2 p(d)) (a wrong ratio) moves position 0's draft mass from 0.30 to 0.60.
    biased = TARGET[0].clone()
    biased[DRAFTS[0]] = 0.6
    biased[torch.arange(V) != DRAFTS[0]] *= 0.4 / 0.7
    assert chi2(np.bincount(first, minlength=V), biased) > 10 * CHI2_CRITICAL_DF7


def test_greedy_rows_accept_exactly_the_argmax_run() -> None:
    """Temperature 0: the output is the argmax at every position up to the first draft that is
    not the argmax, inclusive, as decoding one token at a time would produce."""
    sampler = Sampler(torch.device("cpu"), ModelOptions(seed=0))
    assert _greedy_step(sampler, TARGET).token_ids.tolist() == [3, 4, 2]  # all, then the bonus
    target = TARGET.clone()
    target[1, 0] = 0.5  # position 1's argmax is 0, not the draft 4
    verified = _greedy_step(sampler, target)
    assert verified.num_sampled.tolist() == [2]
    assert verified.token_ids.tolist() == [3, 0]


def _greedy_step(sampler: Sampler, target: torch.Tensor) -> Verified:
    batch = InputBatch(
        max_model_len=64,
        block_size=BS,
        vocab_size=V,
        num_kv_blocks=9,
        capacity=1,
        sampling=SamplingStates(1, V, torch.device("cpu")),
    )
    spec = SpecDecoder(SpeculativeConfig("ngram", 2, 1, 3), max_model_len=64)
    new_req = NewRequestData(
        0, "r0", ids(PROMPT), SamplerParams(temperature=0.0), ids([1, 2]), len(PROMPT) - 1
    )
    step = SchedulerOutput(
        1, [new_req], num_scheduled_tokens=ids([3]), total_num_scheduled_tokens=3,
        num_spec_tokens=ids([2]),
    )  # fmt: skip
    inputs = batch.prepare_inputs(spec.propose(batch, batch.update_states(step)))
    rows, num_tokens = spec.expand(batch, inputs)
    metadata = batch.sampling.build(
        rows, batch.token_ids, batch.num_prompt_tokens[rows], num_tokens
    )
    sampled = sampler(target.log(), metadata).sampled_token_ids.numpy().astype(np.int64)
    return spec.verify(batch, inputs, sampled)

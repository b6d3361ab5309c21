"""Sampler pieces: filters, penalties, logit edits, seeds and log-probabilities."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from splitserve_contracts.engine_options_types import ModelOptions
from splitserve_contracts.sampling_types import SamplerParams
from worker_svc.sample.logprobs import compute_logprobs
from worker_svc.sample.penalties import apply_penalties
from worker_svc.sample.sampler import Sampler, apply_min_p, apply_top_k_top_p
from worker_svc.sample.sampling_metadata import PenaltyInputs, SamplingMetadata, SamplingStates

V = 8
CPU = torch.device("cpu")
NEG_INF = float("-inf")


def build(
    options: list[SamplerParams],
    prompts: list[list[int]],
    outputs: list[list[int]],
    stop_ids: list[list[int]] | None = None,
    min_tokens: list[int] | None = None,
) -> SamplingMetadata:
    """Metadata for rows 0..n-1 holding these requests (prompt then outputs per row)."""
    n = len(options)
    states = SamplingStates(n, V, CPU)
    table = np.zeros((n, 32), np.int32)
    num_prompt = np.zeros(n, np.int64)
    num_tokens = np.zeros(n, np.int64)
    for row, (opt, prompt, out) in enumerate(zip(options, prompts, outputs, strict=True)):
        tokens = prompt + out
        table[row, : len(tokens)] = tokens
        num_prompt[row], num_tokens[row] = len(prompt), len(tokens)
        stops = np.asarray((stop_ids or [[]] * n)[row], np.int64)
        states.add(row, opt, stops, (min_tokens or [0] * n)[row])
    return states.build(np.arange(n), table, num_prompt, num_tokens)


def test_top_k_keeps_k_largest_per_row() -> None:
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]])
    out = apply_top_k_top_p(logits.clone(), torch.tensor([2, 4]), None)
    assert torch.isinf(out[0]).tolist() == [True, False, True, False]
    assert not torch.isinf(out[1]).any()


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = apply_top_k_top_p(probs.log(), None, torch.tensor([0.75]))
    assert torch.isinf(out[0]).tolist() == [False, False, True, True]
    # top_p 1.0 keeps everything; a tiny top_p keeps the most likely token only
    assert not torch.isinf(apply_top_k_top_p(probs.log(), None, torch.tensor([1.0]))).any()
    only = apply_top_k_top_p(probs.log(), None, torch.tensor([0.01]))
    assert (~torch.isinf(only[0])).tolist() == [True, False, False, False]


def test_top_k_and_top_p_together() -> None:
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    out = apply_top_k_top_p(probs.log(), torch.tensor([3]), torch.tensor([0.9]))
    # top-k drops 0.1; among the rest (renormalised 0.44, 0.33, 0.22) 0.9 needs all three
    assert torch.isinf(out[0]).tolist() == [False, False, False, True]


def test_min_p_drops_tokens_below_fraction_of_top() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = apply_min_p(probs.log(), torch.tensor([0.5]))
    assert torch.isinf(out[0]).tolist() == [False, False, True, True]


def test_penalties_follow_vllm_definitions() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0]])
    pen = PenaltyInputs(
        presence=torch.tensor([0.5]),
        frequency=torch.tensor([0.25]),
        repetition=torch.tensor([2.0]),
        output_token_ids=torch.tensor([[0, 0, 4]]),  # 4 = padding
        prompt_token_ids=torch.tensor([[1]]),
    )
    out = apply_penalties(logits.clone(), pen)
    # token 0: repetition 2.0/2, then -0.25*2 frequency, -0.5 presence; token 1 (prompt) -2*2
    assert out[0].tolist() == pytest.approx([1.0 - 0.5 - 0.5, -4.0, 1.0, 1.0])


def test_logit_bias_allowed_ids_and_min_tokens_edit_logits() -> None:
    sampler = Sampler(CPU, ModelOptions(seed=0))
    greedy = SamplerParams(temperature=0.0)
    meta = build(
        [
            SamplerParams(temperature=0.0, logit_bias={3: 100.0}),
            SamplerParams(temperature=0.0, allowed_token_ids=(5, 6)),
            greedy,
            greedy,
            greedy,
        ],
        [[1]] * 5,
        [[], [], [7], [7], []],
        stop_ids=[[], [], [0], [0], [0]],
        min_tokens=[0, 0, 2, 1, 0],
    )
    logits = torch.zeros(5, V)
    logits[:, 0] = 10.0  # token 0 is the argmax everywhere (and a stop id for rows 2-4)
    logits[:, 6] = 5.0
    sampled = sampler(logits, meta).sampled_token_ids.tolist()
    # row 2 has 1 output < min_tokens 2: stop id 0 masked; row 3 reached min_tokens
    assert sampled == [3, 6, 6, 0, 0]


def test_greedy_fast_path_is_argmax() -> None:
    meta = build([SamplerParams(temperature=0.0)] * 3, [[1]] * 3, [[]] * 3)
    assert meta.is_plain_greedy
    logits = torch.randn(3, V)
    assert torch.equal(
        Sampler(CPU, ModelOptions(seed=0))(logits.clone(), meta).sampled_token_ids,
        logits.argmax(-1),
    )


def test_random_sampling_follows_temperature_distribution() -> None:
    meta = build([SamplerParams(temperature=0.5)] * 4000, [[1]] * 4000, [[]] * 4000)
    logits = torch.tensor(
        [0.0, math.log(2.0), NEG_INF, NEG_INF, NEG_INF, NEG_INF, NEG_INF, NEG_INF]
    )
    sampled = Sampler(CPU, ModelOptions(seed=0))(logits.repeat(4000, 1), meta).sampled_token_ids
    # temperature 0.5 squares the odds: p(1) = 4 / 5
    assert abs(float((sampled == 1).float().mean()) - 0.8) < 0.03
    assert set(sampled.tolist()) <= {0, 1}


def test_seeded_rows_ignore_their_batch() -> None:
    seeded = SamplerParams(temperature=1.0, seed=1234)
    logits = torch.randn(1, V).repeat(3, 1)
    alone = [
        Sampler(CPU, ModelOptions(seed=0))(logits[:1].clone(), build([seeded], [[1]], [[]]))
        for _ in range(2)
    ]
    mixed = Sampler(CPU, ModelOptions(seed=99))(
        logits.clone(),
        build(
            [SamplerParams(temperature=1.0), seeded, SamplerParams(temperature=0.0)],
            [[1]] * 3,
            [[]] * 3,
        ),
    )
    assert alone[0].sampled_token_ids.tolist() == alone[1].sampled_token_ids.tolist()
    assert mixed.sampled_token_ids[1] == alone[0].sampled_token_ids[0]
    assert mixed.sampled_token_ids[2] == logits[2].argmax()


def test_seeded_generator_advances_between_steps() -> None:
    meta = build([SamplerParams(temperature=1.0, seed=7)], [[1]], [[]])
    sampler = Sampler(CPU, ModelOptions(seed=0))
    logits = torch.zeros(1, V)
    draws = [int(sampler(logits.clone(), meta).sampled_token_ids[0]) for _ in range(20)]
    assert len(set(draws)) > 1  # a uniform distribution: draws differ across steps


@pytest.mark.parametrize(
    "mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
)
def test_logprobs_mode_picks_what_the_logprobs_are(mode: str) -> None:
    """vLLM's --logprobs-mode: raw (before the bias and temperature) or processed (after them:
    what the token was drawn from), as log-probabilities or as logits."""
    params = SamplerParams(temperature=0.5, logprobs=2, logit_bias={3: 1.0}, seed=1)
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
    processed = logits.clone()
    processed[0, 3] += 1.0
    processed /= 0.5
    expected = {
        "raw_logprobs": torch.log_softmax(logits, -1),
        "raw_logits": logits,
        "processed_logprobs": torch.log_softmax(processed, -1),
        "processed_logits": processed,
    }[mode]
    sampler = Sampler(CPU, ModelOptions(logprobs_mode=mode))
    out = sampler(logits.clone(), build([params], [[1]], [[]]))
    assert out.logprobs is not None
    ids, values, _ = out.logprobs
    assert values[0].tolist() == pytest.approx(expected[0, ids[0]].tolist())
    assert ids[0, 1:].tolist() == [0, 1]  # the top two


def test_logprobs_are_raw_with_ranks() -> None:
    raw = torch.log_softmax(torch.tensor([[1.0, 3.0, 2.0, 0.0]]), dim=-1)
    ids, values, ranks = compute_logprobs(raw, torch.tensor([2]), num_top=2)
    assert ids.tolist() == [[2, 1, 2]]
    assert values[0].tolist() == pytest.approx(raw[0, [2, 1, 2]].tolist())
    assert ranks.tolist() == [2]


def test_sampler_logprobs_come_from_logits_before_penalties() -> None:
    meta = build([SamplerParams(temperature=0.0, logprobs=1, logit_bias={3: 50.0})], [[1]], [[]])
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
    raw = torch.log_softmax(logits, -1)
    out = Sampler(CPU, ModelOptions(seed=0))(logits.clone(), meta)
    assert out.sampled_token_ids.tolist() == [3]  # biased
    assert out.logprobs is not None
    ids, values, ranks = out.logprobs
    assert ids.tolist() == [[3, 0]] and ranks.tolist() == [4]
    assert values[0, 0] == pytest.approx(float(raw[0, 3]))


def test_a_resumed_seeded_request_continues_its_random_stream() -> None:
    """A request resumed on new ranks with k outputs (after a rank or core restart) samples its
    next token as the undisturbed request would: its generator skips the k draws."""
    vocab = 1000
    seeded = SamplerParams(temperature=1.0, seed=4321)
    logits = torch.zeros(1, vocab)  # uniform: the choice is the noise's alone

    def draws(num_output_tokens: int, count: int) -> list[int]:
        states = SamplingStates(1, vocab, CPU)
        states.add(0, seeded, np.zeros(0, np.int64), 0, num_output_tokens)
        table = np.zeros((1, 4), np.int32)
        meta = states.build(np.arange(1), table, np.array([1]), np.array([1]))
        sampler = Sampler(CPU, ModelOptions(seed=0))
        return [int(sampler(logits.clone(), meta).sampled_token_ids[0]) for _ in range(count)]

    undisturbed = draws(0, 6)
    assert undisturbed[4:6] != undisturbed[:2]  # restarting the stream would repeat these
    assert draws(4, 2) == undisturbed[4:6]


def test_a_resumed_request_sends_no_prompt_logprobs_again() -> None:
    states = SamplingStates(2, V, CPU)
    params = SamplerParams(temperature=0.0, prompt_logprobs=1)
    states.add(0, params, np.zeros(0, np.int64), 0)
    states.add(1, params, np.zeros(0, np.int64), 0, num_output_tokens=3)
    assert states.wants_prompt_logprobs(0) and not states.wants_prompt_logprobs(1)


def test_a_preempted_seeded_request_resumes_its_stream_at_its_outputs() -> None:
    """A step in flight (async scheduling) drew for a token the engine core then dropped: when
    the request resumes with k outputs, its generator stands past exactly k draws again."""
    vocab = 1000
    logits = torch.zeros(1, vocab)
    states = SamplingStates(1, vocab, CPU)
    states.add(0, SamplerParams(temperature=1.0, seed=99), np.zeros(0, np.int64), 0)
    meta = states.build(np.arange(1), np.zeros((1, 4), np.int32), np.array([1]), np.array([1]))
    sampler = Sampler(CPU, ModelOptions(seed=0))
    undisturbed = [int(sampler(logits.clone(), meta).sampled_token_ids[0]) for _ in range(4)]
    states.resync_generator(0, 2)  # resumed with 2 outputs after 4 draws
    meta = states.build(np.arange(1), np.zeros((1, 4), np.int32), np.array([1]), np.array([1]))
    assert [int(sampler(logits.clone(), meta).sampled_token_ids[0]) for _ in range(2)] == (
        undisturbed[2:4]
    )

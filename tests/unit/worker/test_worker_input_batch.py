"""InputBatch: state updates from step diffs and vectorized input preparation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from splitserve_contracts.sampling_types import SamplerParams
from tests.fixtures.step_driver import GREEDY, ids
from worker_svc.runner.input_batch import InputBatch
from worker_svc.sample.sampling_metadata import SamplingStates
from worker_svc.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from worker_svc.step_checks import MalformedStep

BS = 4
NULL = 0  # the null block pads block tables
NUM_BLOCKS = 999


def make_batch(capacity: int = 2) -> InputBatch:
    return InputBatch(
        max_model_len=64,
        block_size=BS,
        vocab_size=100,
        num_kv_blocks=NUM_BLOCKS,
        capacity=capacity,
        sampling=SamplingStates(capacity, 100, torch.device("cpu")),
    )


def new(handle: int, prompt: list[int], blocks: list[int], computed: int = 0) -> NewRequestData:
    return NewRequestData(handle, f"r{handle}", ids(prompt), GREEDY, ids(blocks), computed)


def step(
    step_id: int,
    new_reqs: list[NewRequestData],
    sched: list[int],
    cached: CachedRequestData | None = None,
    finished: tuple[int, ...] = (),
) -> SchedulerOutput:
    return SchedulerOutput(
        step_id=step_id,
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=cached or CachedRequestData(),
        num_scheduled_tokens=ids(sched),
        total_num_scheduled_tokens=sum(sched),
        finished_req_handles=ids(list(finished)),
    )


def cached(
    handles: list[int],
    computed: list[int],
    new_blocks: list[list[int]],
    new_tokens: list[list[int]],
    resumed: dict[int, list[int]] | None = None,
) -> CachedRequestData:
    resumed = resumed or {}
    return CachedRequestData(
        req_handles=ids(handles),
        num_computed_tokens=ids(computed),
        num_new_block_ids=ids([len(b) for b in new_blocks]),
        new_block_ids=ids([x for b in new_blocks for x in b]),
        num_new_token_ids=ids([len(t) for t in new_tokens]),
        new_token_ids=ids([x for t in new_tokens for x in t]),
        resumed_req_handles=ids(list(resumed)),
        num_resumed_token_ids=ids([len(t) for t in resumed.values()]),
        resumed_all_token_ids=ids([x for t in resumed.values() for x in t]),
    )


def test_mixed_batch_inputs() -> None:
    batch = make_batch()
    # Request 7: a 6-token prompt chunked as 4 + 2; request 8: prefix hit of 4 tokens.
    s1 = step(
        1,
        [new(7, [10, 11, 12, 13, 14, 15], [3, 5]), new(8, [20, 21, 22, 23, 24], [6, 2], 4)],
        [4, 1],
    )
    plan = batch.update_states(s1)
    fresh = plan.fresh_block_ids
    inputs = batch.prepare_inputs(plan)
    assert inputs.input_ids.tolist() == [10, 11, 12, 13, 24]
    assert inputs.positions.tolist() == [0, 1, 2, 3, 4]
    assert inputs.slot_mapping.tolist() == [12, 13, 14, 15, 2 * BS + 0]
    assert inputs.query_start_loc.tolist() == [0, 4, 5]
    assert inputs.seq_lens.tolist() == [4, 5]
    assert inputs.block_tables.tolist() == [[3, NULL], [6, 2]]
    # Request 7's chunk ends mid-prompt: only request 8 samples, from its last token.
    assert inputs.logits_indices.tolist() == [4]
    assert inputs.sampling_reqs.tolist() == [1]
    assert inputs.req_handles.tolist() == [7, 8]
    # Fresh blocks exclude request 8's prefix-hit block 6.
    assert sorted(fresh.tolist()) == [2, 3, 5]
    batch.finish_step(inputs)

    # Step 2: request 7 finishes its prompt, request 8 decodes its sampled token 50.
    s2 = step(2, [], [2, 1], cached([7, 8], [4, 5], [[], []], [[], [50]]))
    plan = batch.update_states(s2)
    fresh = plan.fresh_block_ids
    inputs = batch.prepare_inputs(plan)
    assert inputs.input_ids.tolist() == [14, 15, 50]
    assert inputs.positions.tolist() == [4, 5, 5]
    assert inputs.slot_mapping.tolist() == [5 * BS, 5 * BS + 1, 2 * BS + 1]
    assert inputs.logits_indices.tolist() == [1, 2]
    assert len(fresh) == 0


def test_append_then_resume_replaces_blocks_and_tokens() -> None:
    batch = make_batch()
    s1 = step(1, [new(1, [5, 6, 7], [10])], [3])
    batch.finish_step(batch.prepare_inputs(batch.update_states(s1)))
    s2 = step(2, [], [1], cached([1], [3], [[4]], [[8]]))
    plan = batch.update_states(s2)
    row, fresh = int(plan.rows[0]), plan.fresh_block_ids
    assert batch.block_table[row, :2].tolist() == [10, 4] and fresh.tolist() == [4]
    assert batch.token_ids[row, :4].tolist() == [5, 6, 7, 8]
    batch.finish_step(batch.prepare_inputs(plan))
    # Preempted, then resumed: new blocks replace the list, tokens are rebuilt.
    s3 = step(3, [], [6], cached([1], [0], [[9, 11]], [[30]], resumed={1: [5, 6, 7, 8, 30, 31]}))
    plan = batch.update_states(s3)
    fresh = plan.fresh_block_ids
    assert batch.num_blocks[row] == 2 and batch.block_table[row, :2].tolist() == [9, 11]
    assert batch.token_ids[row, :6].tolist() == [5, 6, 7, 8, 30, 31]
    assert batch.num_tokens[row] == 6 and sorted(fresh.tolist()) == [9, 11]
    inputs = batch.prepare_inputs(plan)
    assert inputs.positions.tolist() == list(range(6))
    assert inputs.logits_indices.tolist() == [5]


def test_finished_requests_are_dropped_and_rows_reused() -> None:
    batch = make_batch(capacity=1)
    batch.update_states(step(1, [new(1, [5], [10])], [1]))
    batch.update_states(step(2, [new(2, [6], [1])], [1]))  # grows past capacity 1
    assert batch.num_reqs == 2 and batch.capacity == 2
    batch.update_states(step(3, [], [], finished=(1, 12345)))  # unknown handles are ignored
    assert set(batch.handle_to_row) == {2}
    refused = batch.update_states(step(4, [], [1], cached([1], [1], [[]], [[3]])))
    assert "unknown" in refused.failed[1] and not len(refused.rows)


def test_num_used_blocks_counts_shared_blocks_once() -> None:
    batch = make_batch()
    s1 = step(1, [new(1, list(range(8)), [10, 1]), new(2, list(range(6)), [10, 3], 4)], [8, 2])
    batch.finish_step(batch.prepare_inputs(batch.update_states(s1)))
    assert batch.num_used_blocks() == 3


@pytest.mark.parametrize(
    ("sched", "blocks", "message"),
    [([5], [10, 1], "5 tokens scheduled"), ([4], [], "0 blocks"), ([0], [10, 1], "0 tokens")],
)
def test_schedules_a_request_cannot_run_refuse_that_request(
    sched: list[int], blocks: list[int], message: str
) -> None:
    batch = make_batch()
    s = step(1, [new(1, [1, 2, 3, 4], blocks), new(2, [7, 8], [20])], [*sched, 2])
    plan = batch.update_states(s)
    assert message in plan.failed[1] and set(batch.handle_to_row) == {2}
    assert plan.num_scheduled_tokens.tolist() == [2]
    assert batch.prepare_inputs(plan).input_ids.tolist() == [7, 8]


def test_prompt_longer_than_max_model_len_is_refused() -> None:
    plan = make_batch().update_states(step(1, [new(1, list(range(65)), list(range(1, 18)))], [65]))
    assert "max_model_len" in plan.failed[1] and not len(plan.rows)


def test_bad_sampler_params_refuse_that_request_only() -> None:
    batch = make_batch()
    bad = NewRequestData(1, "r1", ids([1, 2]), SamplerParams(top_p=1.5), ids([10]))
    plan = batch.update_states(step(1, [bad, new(2, [3, 4], [30])], [2, 2]))
    assert "top_p must be in (0, 1]" in plan.failed[1]
    assert set(batch.handle_to_row) == {2}


def test_a_bad_cached_diff_refuses_that_request_only() -> None:
    batch = make_batch()
    plan = batch.update_states(step(1, [new(1, [5, 6], [10]), new(2, [7, 8], [11])], [2, 2]))
    batch.finish_step(batch.prepare_inputs(plan))
    diff = cached([1, 2], [2, 2], [[NUM_BLOCKS + 5], []], [[9], [100]])
    plan = batch.update_states(step(2, [], [1, 1], diff))
    assert "block ids" in plan.failed[1] and "vocabulary" in plan.failed[2]
    assert not batch.handle_to_row and not len(plan.rows)


@pytest.mark.parametrize(
    "bad_step",
    [
        step(1, [new(1, [5], [10])], [1, 1]),  # more counts than requests
        step(1, [new(1, [5], [10]), new(1, [6], [11])], [1, 1]),  # one handle twice
        SchedulerOutput(
            1, [new(1, [5], [10])], num_scheduled_tokens=ids([1]), total_num_scheduled_tokens=3
        ),  # fmt: skip
    ],
)
def test_a_malformed_step_changes_nothing(bad_step: SchedulerOutput) -> None:
    batch = make_batch()
    with pytest.raises(MalformedStep):
        batch.update_states(bad_step)
    assert not batch.handle_to_row


def test_positions_are_vectorized_over_many_requests() -> None:
    batch = make_batch(capacity=64)
    rng = np.random.default_rng(0)
    reqs, sched = [], []
    for h in range(50):
        n = int(rng.integers(1, 9))
        reqs.append(new(h, [h] * n, [2 * h + 1, 2 * h + 2]))
        sched.append(n)
    s = step(1, reqs, sched)
    inputs = batch.prepare_inputs(batch.update_states(s))
    expected_pos = np.concatenate([np.arange(n) for n in sched])
    assert np.array_equal(inputs.positions, expected_pos)
    req_of_token = np.repeat(np.arange(50), sched)
    assert np.array_equal(inputs.input_ids, req_of_token)
    expected_slots = (2 * req_of_token + 1 + expected_pos // BS) * BS + expected_pos % BS
    assert np.array_equal(inputs.slot_mapping, expected_slots)
    assert np.array_equal(inputs.logits_indices, np.cumsum(sched) - 1)


@pytest.mark.parametrize(
    ("request_data", "message"),
    [
        (new(1, [1, 2], [NULL]), "block ids outside 1..998"),
        (new(1, [1, 2], [NUM_BLOCKS]), "block ids outside 1..998"),
        (new(1, [1, 100], [10]), "outside the vocabulary"),
        (new(1, [1, 2], [10], computed=2), "computed tokens"),
    ],
)
def test_out_of_range_ids_refuse_that_request_only(
    request_data: NewRequestData, message: str
) -> None:
    batch = make_batch()
    plan = batch.update_states(step(1, [request_data, new(2, [3, 4], [30])], [2, 2]))
    assert message in plan.failed[1]
    assert set(batch.handle_to_row) == {2} and plan.num_scheduled_tokens.tolist() == [2]


def test_a_new_request_may_bring_the_outputs_it_had() -> None:
    """A request resumed on new ranks (a rank or the core restarted): its outputs follow the
    prompt, are recomputed like it, and count as outputs (penalties, min_tokens)."""
    batch = make_batch()
    resumed = dataclasses.replace(new(3, [5, 6, 7], [10, 11]), output_token_ids=ids([30, 31]))
    plan = batch.update_states(step(1, [resumed], [5]))
    row = int(plan.rows[0])
    assert batch.token_ids[row, :5].tolist() == [5, 6, 7, 30, 31]
    assert (batch.num_prompt_tokens[row], batch.num_tokens[row]) == (3, 5)
    inputs = batch.prepare_inputs(plan)
    assert inputs.input_ids.tolist() == [5, 6, 7, 30, 31]
    assert inputs.positions.tolist() == list(range(5)) and inputs.logits_indices.tolist() == [4]


@pytest.mark.parametrize(
    ("outputs", "problem"),
    [([30, 100], "output token id outside the vocabulary"), (list(range(62)), "do not fit")],
)
def test_bad_outputs_of_a_resumed_request_refuse_it(outputs: list[int], problem: str) -> None:
    batch = make_batch()
    resumed = dataclasses.replace(new(3, [5, 6, 7], [10]), output_token_ids=ids(outputs))
    plan = batch.update_states(step(1, [resumed], [3]))
    assert problem in plan.failed[3] and batch.num_reqs == 0


def test_async_scheduling_feeds_the_sampled_token_to_the_next_step() -> None:
    """The core scheduled step 2 before step 1's token came back: no new token ids arrive, the
    rank's own sampled token is step 2's input, and a row at max_model_len takes none."""
    batch = make_batch()
    plan = batch.update_states(step(1, [new(1, [5, 6, 7], [1])], [3]))
    inputs = batch.prepare_inputs(plan)
    batch.finish_step(inputs)
    batch.append_sampled(inputs.rows[inputs.sampling_reqs], np.array([42]))
    plan = batch.update_states(step(2, [], [1], cached([1], [3], [[]], [[]])))
    inputs = batch.prepare_inputs(plan)
    assert inputs.input_ids.tolist() == [42] and inputs.positions.tolist() == [3]
    assert inputs.sampling_reqs.tolist() == [0]
    row = inputs.rows[:1]
    batch.num_tokens[row] = batch.max_model_len
    batch.append_sampled(row, np.array([43]))
    assert int(batch.num_tokens[row[0]]) == batch.max_model_len

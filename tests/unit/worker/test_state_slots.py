"""A rank's side of the state group: the state slots the core sends are checked like block
ids (a request with a wrong slot is refused alone), fresh slots are zeroed, and the state cache
gives each layer its own cache in layer order."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tests.fixtures.step_driver import GREEDY, ids
from worker_svc.layers.state_cache import StateMetadata, StateSpec
from worker_svc.runner.input_batch import InputBatch
from worker_svc.runner.state_cache import StateCache
from worker_svc.sample.sampling_metadata import SamplingStates
from worker_svc.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from worker_svc.step_checks import MalformedStep

BS = 4


def make_batch(num_state_slots: int) -> InputBatch:
    return InputBatch(
        max_model_len=64,
        block_size=BS,
        vocab_size=100,
        num_kv_blocks=99,
        capacity=4,
        sampling=SamplingStates(4, 100, torch.device("cpu")),
        num_state_slots=num_state_slots,
    )


def new(handle: int, slot: int, blocks: list[int], computed: int = 0) -> NewRequestData:
    prompt = ids([1, 2, 3, 4, 5])
    return NewRequestData(
        handle, f"r{handle}", prompt, GREEDY, ids(blocks), computed, state_slot=slot
    )


def step(
    new_reqs: list[NewRequestData], cached: CachedRequestData | None = None
) -> SchedulerOutput:
    cached = cached or CachedRequestData()
    sched = [5] * len(new_reqs) + [5] * cached.num_reqs
    return SchedulerOutput(
        step_id=1,
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=ids(sched),
        total_num_scheduled_tokens=sum(sched),
    )


def test_new_requests_take_their_own_slots_and_a_wrong_slot_fails_only_its_request() -> None:
    batch = make_batch(num_state_slots=4)
    plan = batch.update_states(
        step([new(1, 2, [1, 2]), new(2, 2, [3, 4]), new(3, 0, [5, 6]), new(4, 4, [7, 8])])
    )
    assert plan.fresh_state_slots.tolist() == [2, 2]
    assert "state slot 2 is another request's in this step" in plan.failed[2]
    assert plan.rows.tolist() == [batch.handle_to_row[1]]
    assert "outside 1..3" in plan.failed[3] and "outside 1..3" in plan.failed[4]
    assert batch.state_slots[batch.handle_to_row[1]] == 2


def test_a_preempted_requests_slot_may_go_to_a_new_request() -> None:
    """The core took the slot back when it preempted request 1 (the rank keeps its row until it
    resumes with a new slot); a new request given that slot runs, and so does 1 resumed."""
    batch = make_batch(num_state_slots=4)
    batch.update_states(step([new(1, 1, [1, 2])]))
    plan = batch.update_states(step([new(2, 1, [3, 4])]))
    assert not plan.failed and plan.fresh_state_slots.tolist() == [1]
    plan = batch.update_states(step([], resumed(1, [2])))
    assert not plan.failed and plan.fresh_state_slots.tolist() == [2]


def test_a_request_with_state_starts_at_its_first_token() -> None:
    plan = make_batch(num_state_slots=4).update_states(step([new(1, 1, [1, 2], computed=4)]))
    assert "starts at its first" in plan.failed[1]


def test_a_model_without_state_layers_refuses_a_slot() -> None:
    plan = make_batch(num_state_slots=0).update_states(step([new(1, 1, [1, 2])]))
    assert "without state layers" in plan.failed[1]


def resumed(handle: int, slots: list[int]) -> CachedRequestData:
    return CachedRequestData(
        req_handles=ids([handle]),
        num_computed_tokens=ids([0]),
        num_new_block_ids=ids([2]),
        new_block_ids=ids([5, 6]),
        num_new_token_ids=ids([0]),
        new_token_ids=ids([]),
        resumed_req_handles=ids([handle]),
        num_resumed_token_ids=ids([5]),
        resumed_all_token_ids=ids([1, 2, 3, 4, 5]),
        resumed_state_slots=ids(slots),
    )


def test_a_resumed_request_takes_its_new_slot_fresh() -> None:
    batch = make_batch(num_state_slots=4)
    batch.update_states(step([new(1, 1, [1, 2])]))
    plan = batch.update_states(step([], resumed(1, [3])))
    assert plan.fresh_state_slots.tolist() == [3] and not plan.failed
    assert batch.state_slots[batch.handle_to_row[1]] == 3
    plan = batch.update_states(step([], resumed(1, [0])))
    assert "resumed state slot" in plan.failed[1]
    with pytest.raises(MalformedStep, match="resumed_state_slots"):
        batch.update_states(step([], dataclasses.replace(resumed(1, [1, 2]))))


SPECS = [
    StateSpec(((3, 2), (2, 2, 2)), torch.float32),
    None,
    StateSpec(((3, 2), (2, 2, 2)), torch.float32),
]


def test_the_state_cache_zeroes_fresh_slots_and_interleaves_the_layers() -> None:
    cache = StateCache(SPECS, 4, torch.device("cpu"))
    assert cache.nbytes == 2 * 4 * (6 + 8) * 4
    for layer in cache.layers:
        for tensor in layer:
            tensor.fill_(1.0)
    cache.zero_slots(np.array([2]))
    assert float(cache.layers[0][1][2].abs().sum()) == 0.0
    assert float(cache.layers[1][0][1].sum()) == 6.0, "the other slots keep their state"
    kv = [torch.zeros(1)]
    caches = cache.layer_caches(kv)
    assert caches[1] is kv[0] and caches[0] is cache.layers[0] and caches[2] is cache.layers[1]
    with pytest.raises(ValueError, match="state slot"):
        cache.zero_slots(np.array([0]))


def test_state_metadata_splits_decodes_from_prefills() -> None:
    meta = StateMetadata.of([0, 1, 4, 5], [7, 0, 3], [2, 1, 3], torch.device("cpu"))
    assert meta.decode_rows == [0, 2] and meta.prefill_rows == [1]
    assert meta.slots.tolist() == [2, 1, 3] and meta.num_reqs == 3
    assert meta.decode_tokens.tolist() == [0, 4] and meta.decode_slots.tolist() == [2, 3]
    assert meta.decode_fresh.tolist() == [False, False]

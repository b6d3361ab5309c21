"""StepBuilder: the order of a step is the contract's whatever order requests are added in."""

from __future__ import annotations

import pytest

from core_svc.kv_cache.block_pool import KVCacheBlock
from core_svc.request import Request
from core_svc.sched.step_builder import StepBuilder
from tests.unit.core.fake_executor import make_request


def running(handle: int, num_tokens: int, num_sent: int) -> Request:
    request = make_request(handle, list(range(num_tokens)))
    request.req_handle = handle
    request.num_sent_token_ids = num_sent
    request.num_computed_tokens = num_sent
    return request


def test_new_then_running_then_resumed_whatever_the_order_of_adds() -> None:
    step = StepBuilder(step_id=7, finished_req_handles=[99])
    fresh = running(1, 5, 0)
    resumed = running(3, 6, 6)
    step.add_running(running(2, 9, 8), 1, [KVCacheBlock(4)])
    step.add_new(fresh, 5, [10, 11])
    step.add_running(running(4, 3, 3), 1, [])
    step.add_resumed(resumed, 6, [12, 13])
    output, scheduled = step.build()
    assert [r.req_handle for r in scheduled] == [1, 2, 4, 3]
    assert output.num_scheduled_tokens == [5, 1, 1, 6] and output.total_num_scheduled_tokens == 13
    assert [r.req_handle for r in output.scheduled_new_reqs] == [1]
    cached = output.scheduled_cached_reqs
    assert cached.req_handles == [2, 4, 3] and cached.resumed_req_handles == [3]
    assert cached.num_new_block_ids == [1, 0, 2] and cached.new_block_ids == [4, 12, 13]
    assert cached.num_new_token_ids == [1, 0, 0] and cached.new_token_ids == [8]
    assert output.finished_req_handles == [99] and output.step_id == 7
    assert fresh.is_known_to_workers and fresh.num_sent_token_ids == 5


def test_a_preempted_running_request_is_taken_back_out() -> None:
    step = StepBuilder(step_id=1, finished_req_handles=[])
    first, victim = running(1, 4, 3), running(2, 7, 5)
    step.add_running(first, 1, [KVCacheBlock(5)])
    step.add_running(victim, 2, [KVCacheBlock(6), KVCacheBlock(7)])
    assert step.remove_running(victim) == 2
    assert step.remove_running(victim) is None
    output, scheduled = step.build()
    assert scheduled == [first] and output.num_scheduled_tokens == [1]
    cached = output.scheduled_cached_reqs
    assert (cached.req_handles, cached.new_block_ids, cached.new_token_ids) == ([1], [5], [3])


def test_running_after_resumed_breaks_the_order_and_is_refused() -> None:
    step = StepBuilder(step_id=1, finished_req_handles=[])
    step.add_resumed(running(1, 4, 4), 4, [3])
    step.add_running(running(2, 4, 3), 1, [])
    with pytest.raises(AssertionError, match="before resumed"):
        step.build()

"""Scheduler behaviour, driven through EngineCore with the FakeExecutor."""

from __future__ import annotations

from core_svc.engine.engine_core import EngineCore
from core_svc.sched.scheduler_output import SchedulerOutput
from splitserve_contracts.output_types import EngineCoreEventType, FinishReason
from tests.unit.core.fake_executor import (
    ClientView,
    FakeExecutor,
    make_engine,
    make_request,
    run_to_completion,
)


def new_handles(so: SchedulerOutput) -> list[int]:
    return [r.req_handle for r in so.scheduled_new_reqs]


def scheduled(so: SchedulerOutput) -> dict[int, int]:
    """req_handle -> tokens scheduled in this step."""
    handles = new_handles(so) + so.scheduled_cached_reqs.req_handles
    return dict(zip(handles, so.num_scheduled_tokens, strict=True))


def step(engine: EngineCore, executor: FakeExecutor, view: ClientView) -> SchedulerOutput:
    view.absorb(engine.step())
    return executor.seen[-1]


def test_prefill_and_decode_share_one_step() -> None:
    engine, executor = make_engine()
    view = ClientView()
    engine.add_request(make_request(1, list(range(6)), max_tokens=5))
    first = step(engine, executor, view)
    assert new_handles(first) == [1] and first.num_scheduled_tokens == [6]
    engine.add_request(make_request(2, list(range(50, 60)), max_tokens=5))
    second = step(engine, executor, view)
    assert new_handles(second) == [2]
    assert second.scheduled_cached_reqs.req_handles == [1]
    assert second.num_scheduled_tokens == [10, 1]
    assert second.total_num_scheduled_tokens == 11
    assert second.scheduled_cached_reqs.new_token_ids == view.tokens[(1, 1)][:1]
    assert second.scheduled_cached_reqs.num_computed_tokens == [6]
    assert [len(view.tokens[(1, h)]) for h in (1, 2)] == [2, 1]


def test_long_prompt_is_chunked_while_decodes_keep_flowing() -> None:
    engine, executor = make_engine(max_num_batched_tokens=16, num_blocks=128)
    view = ClientView()
    for handle in (1, 2, 3):
        engine.add_request(make_request(handle, [handle] * 3, max_tokens=50))
    step(engine, executor, view)
    engine.add_request(make_request(9, list(range(40)), max_tokens=3))
    chunks = []
    for _ in range(4):
        so = step(engine, executor, view)
        per_request = scheduled(so)
        assert [per_request[h] for h in (1, 2, 3)] == [1, 1, 1]
        assert so.total_num_scheduled_tokens <= 16
        chunks.append(per_request[4])
        if len(chunks) < 4:
            assert (1, 9) not in view.tokens, "a partial prefill chunk samples nothing"
    assert chunks == [13, 13, 13, 1]
    assert len(view.tokens[(1, 9)]) == 1
    assert [len(view.tokens[(1, h)]) for h in (1, 2, 3)] == [5, 5, 5]


def test_long_prefill_token_threshold_caps_each_chunk() -> None:
    engine, executor = make_engine(long_prefill_token_threshold=5)
    engine.add_request(make_request(1, list(range(12)), max_tokens=2))
    engine.add_request(make_request(2, list(range(50, 53)), max_tokens=8))
    run_to_completion(engine)
    assert [scheduled(so).get(1) for so in executor.seen[:4]] == [5, 5, 2, 1]
    assert scheduled(executor.seen[0])[2] == 3


def test_prefill_token_budget_bounds_prompt_tokens_while_requests_decode() -> None:
    engine, executor = make_engine(max_num_batched_tokens=64, prefill_token_budget=8)
    view = ClientView()
    for handle in (1, 2):
        engine.add_request(make_request(handle, [handle] * 20, max_tokens=30))
    first = step(engine, executor, view)
    assert first.num_scheduled_tokens == [20, 20], "nothing decodes yet: the whole budget"
    for handle in (3, 4):
        engine.add_request(make_request(handle, list(range(handle * 10, handle * 10 + 12)), 1,
                                        max_tokens=3))  # fmt: skip
    prompt_tokens = []
    for _ in range(3):
        per_request = scheduled(step(engine, executor, view))
        assert per_request[1] == per_request[2] == 1, "decodes keep flowing"
        prompt_tokens.append([per_request.get(3, 0), per_request.get(4, 0)])
    assert prompt_tokens == [[8, 0], [4, 4], [1, 8]]  # 3 decodes once its 12 are in


def test_max_num_seqs_limits_running_requests() -> None:
    engine, executor = make_engine(max_num_seqs=2)
    for handle in range(1, 5):
        engine.add_request(make_request(handle, [handle] * 4, max_tokens=3))
    view = ClientView()
    first = step(engine, executor, view)
    assert new_handles(first) == [1, 2]
    assert engine.make_stats().num_waiting_reqs == 2
    run_to_completion(engine, view)
    assert max(len(scheduled(so)) for so in executor.seen) == 2
    assert all(len(view.tokens[(1, h)]) == 3 for h in range(1, 5))


def preemption_workload(engine: EngineCore) -> None:
    engine.add_request(make_request(1, list(range(8)), max_tokens=8, ignore_eos=True))
    engine.add_request(make_request(2, list(range(100, 108)), max_tokens=8, ignore_eos=True))


def test_fcfs_preempts_the_last_running_request_and_resumes_it() -> None:
    engine, executor = make_engine(num_blocks=7)  # 6 usable blocks of 4 tokens
    preemption_workload(engine)
    view = run_to_completion(engine)
    stats = engine.make_stats()
    assert stats.num_preemptions >= 1
    preempting = next(so for so in executor.seen if 2 not in scheduled(so) and 1 in scheduled(so))
    assert preempting.scheduled_new_reqs == []
    assert preempting.scheduled_cached_reqs.resumed_req_handles == []
    resumed = next(so for so in executor.seen if so.scheduled_cached_reqs.resumed_req_handles)
    cached = resumed.scheduled_cached_reqs
    assert cached.resumed_req_handles == [2]
    assert 2 in cached.req_handles
    index = cached.req_handles.index(2)
    assert cached.num_new_token_ids[index] == 0
    num_blocks = -(-(cached.num_computed_tokens[index] + scheduled(resumed)[2]) // 4)
    assert cached.num_new_block_ids[index] == num_blocks, "the whole block list, replaced"
    assert cached.resumed_all_token_ids[:8] == list(range(100, 108))
    assert cached.num_resumed_token_ids == [len(cached.resumed_all_token_ids)]
    events = [e.type for d in view.details[(1, 2)] for e in d.events]
    assert EngineCoreEventType.PREEMPTED in events
    assert events.count(EngineCoreEventType.SCHEDULED) == 2
    # Same tokens as a run in a cache big enough never to preempt.
    roomy, _ = make_engine(num_blocks=64)
    preemption_workload(roomy)
    assert run_to_completion(roomy).tokens == view.tokens
    assert roomy.make_stats().num_preemptions == 0
    assert stats.kv_cache_usage == 0.0


def test_priority_policy_admits_by_priority_and_preempts_the_lowest() -> None:
    engine, executor = make_engine(num_blocks=7, policy="priority", max_num_seqs=2)
    engine.add_request(make_request(1, list(range(8)), max_tokens=8, priority=1))
    engine.add_request(make_request(2, list(range(100, 108)), max_tokens=8, priority=0))
    engine.add_request(make_request(3, [7] * 3, max_tokens=1, priority=5))
    view = ClientView()
    first = step(engine, executor, view)
    assert new_handles(first) == [2, 1]
    while engine.make_stats().num_preemptions == 0:
        step(engine, executor, view)
    preempting = executor.seen[-1]
    assert scheduled(preempting).keys() == {2}, "request 1 (priority 1) is the victim"
    run_to_completion(engine, view)
    assert view.finished == {(1, 1): FinishReason.LENGTH, (1, 2): FinishReason.LENGTH,
                             (1, 3): FinishReason.LENGTH}  # fmt: skip


def test_no_waiting_request_is_admitted_in_a_step_that_preempted() -> None:
    def run(add_small_before_step: int) -> tuple[list[int], FakeExecutor]:
        """Returns the cumulative preemptions after each step."""
        engine, executor = make_engine(num_blocks=7, policy="priority")
        engine.add_request(make_request(1, list(range(8)), max_tokens=8, priority=0))
        engine.add_request(make_request(2, list(range(100, 108)), max_tokens=8, priority=1))
        preemptions = []
        for step_id in range(1, 30):
            if step_id == add_small_before_step:
                engine.add_request(make_request(3, [5], max_tokens=1, priority=-1))
            engine.step()
            preemptions.append(engine.make_stats().num_preemptions)
        return preemptions, executor

    preemptions, _ = run(-1)
    preempting_step = preemptions.index(1) + 1
    preemptions, executor = run(preempting_step)
    assert preemptions.index(1) + 1 == preempting_step
    assert scheduled(executor.seen[preempting_step - 1]).keys() == {1}
    # Request 3 ranks first and fits, yet waits for the next step.
    assert new_handles(executor.seen[preempting_step]) == [3]


def test_priority_victim_already_scheduled_this_step_is_unscheduled() -> None:
    # Request 1 (low priority) is ahead of request 2 in running; when 2 needs a block,
    # 1 is preempted although it was already scheduled in the same step.
    engine, executor = make_engine(num_blocks=5, policy="priority", block_size=4)
    engine.add_request(make_request(1, list(range(6)), max_tokens=8, priority=3))
    view = ClientView()
    step(engine, executor, view)
    engine.add_request(make_request(2, list(range(50, 58)), max_tokens=8, priority=0))
    while engine.make_stats().num_preemptions == 0:
        step(engine, executor, view)
    preempting = executor.seen[-1]
    assert scheduled(preempting) == {2: 1}
    assert preempting.total_num_scheduled_tokens == 1
    run_to_completion(engine, view)
    assert len(view.tokens[(1, 1)]) == len(view.tokens[(1, 2)]) == 8


def test_prefix_hit_computes_only_the_new_blocks() -> None:
    engine, executor = make_engine()
    view = ClientView()
    engine.add_request(make_request(1, list(range(12)), max_tokens=2))
    step(engine, executor, view)
    engine.add_request(make_request(2, [*range(12), 50, 51, 52, 53, 54], max_tokens=2))
    engine.add_request(make_request(3, list(range(12)), max_tokens=2))
    engine.add_request(make_request(4, [*range(12), 60], max_tokens=2, cache_salt="other"))
    so = step(engine, executor, view)
    computed = {r.req_handle: r.num_computed_tokens for r in so.scheduled_new_reqs}
    assert computed == {2: 12, 3: 8, 4: 0}
    assert scheduled(so) == {1: 1, 2: 5, 3: 4, 4: 13}
    first_details = {h: view.details[(1, h)][0] for h in (2, 3, 4)}
    assert {h: d.num_cached_tokens for h, d in first_details.items()} == {2: 12, 3: 8, 4: 0}
    stats = engine.make_stats()
    assert stats.prefix_cache_queries == 12 + 17 + 12 + 13
    assert stats.prefix_cache_hits == 12 + 8
    run_to_completion(engine, view)
    assert engine.make_stats().kv_cache_usage == 0.0


def test_blocks_of_a_request_in_flight_are_not_hit_in_the_same_step() -> None:
    engine, executor = make_engine()
    engine.add_request(make_request(1, list(range(12)), max_tokens=2))
    engine.add_request(make_request(2, list(range(13)), max_tokens=2))
    engine.step()
    assert [r.num_computed_tokens for r in executor.seen[0].scheduled_new_reqs] == [0, 0]


def test_finished_handles_reach_the_next_step_even_when_it_schedules_nothing() -> None:
    engine, executor = make_engine()
    engine.add_request(make_request(1, [1, 2, 3], max_tokens=2))
    view = run_to_completion(engine)
    assert view.finished == {(1, 1): FinishReason.LENGTH}
    last = executor.seen[-1]
    assert last.finished_req_handles == [1]
    assert last.total_num_scheduled_tokens == 0
    assert [so.step_id for so in executor.seen] == [1, 2, 3]
    assert not engine.has_work()
    assert engine.step() == {}
    assert len(executor.seen) == 3


def test_new_token_ids_carry_each_sampled_token_once() -> None:
    engine, executor = make_engine()
    engine.add_request(make_request(1, [5, 6, 7], max_tokens=6))
    view = run_to_completion(engine)
    sent = [t for so in executor.seen for t in so.scheduled_cached_reqs.new_token_ids]
    assert sent == view.tokens[(1, 1)][:-1]


def test_outputs_are_split_per_client() -> None:
    engine, _ = make_engine()
    engine.add_request(make_request(1, [1, 2, 3], client_id=10, max_tokens=2))
    engine.add_request(make_request(1, [1, 2, 3], client_id=20, max_tokens=3))
    outputs = engine.step()
    assert outputs.keys() == {10, 20}
    assert outputs[10].request_handles == [1] and outputs[20].request_handles == [1]
    assert outputs[10].scheduler_stats is not None
    assert outputs[10].step_id == 1
    view = run_to_completion(engine)
    assert view.finished.keys() == {(10, 1), (20, 1)}

"""Async scheduling in the engine core: step N+1 is scheduled and sent before step N's output
is applied (a queue of two steps), decodes run on output placeholders the ranks fill with
their own sampled tokens, and what a step in flight computes for a request that finished,
was preempted or was aborted meanwhile is dropped."""

from __future__ import annotations

import pytest

from core_svc.engine.engine_core import EngineCore
from splitserve_contracts.output_types import FinishReason
from tests.unit.core.fake_executor import (
    ClientView,
    FakeExecutor,
    make_engine,
    make_request,
    run_to_completion,
)

EOS = 2


def _add(engine: EngineCore, executor: FakeExecutor, num_reqs: int, max_tokens: int) -> None:
    for handle in range(1, num_reqs + 1):
        request = make_request(
            handle, list(range(10, 10 + 3 * handle)), eos_token_id=EOS, max_tokens=max_tokens
        )
        executor.scripts[request.request_id] = [5, 6, EOS] if handle == 2 else []
        engine.add_request(request)


def _run(is_async: bool, **limits: int) -> tuple[ClientView, EngineCore, FakeExecutor]:
    engine, executor = make_engine(async_scheduling=is_async, **limits)
    _add(engine, executor, num_reqs=6, max_tokens=7)
    return run_to_completion(engine), engine, executor


def _handles_in(executor: FakeExecutor, req_handle: int) -> list[int]:
    """Step ids that scheduled the request."""
    return [
        so.step_id
        for so in executor.seen
        if req_handle in so.scheduled_cached_reqs.req_handles
        or any(new.req_handle == req_handle for new in so.scheduled_new_reqs)
    ]


def test_the_next_decode_is_scheduled_before_the_sampled_token_is_known() -> None:
    engine, executor = make_engine(async_scheduling=True)
    request = make_request(1, [10, 11, 12, 13, 14], max_tokens=4, ignore_eos=True)
    engine.add_request(request)
    assert engine.step() == {}  # step 1 (the prefill) is in flight; nothing to apply yet
    assert request.num_output_placeholders == 1
    outputs = engine.step()  # schedules step 2 on the placeholder, then applies step 1
    second = executor.seen[1].scheduled_cached_reqs
    assert (second.req_handles, second.num_computed_tokens) == ([request.req_handle], [5])
    assert second.num_new_token_ids == [0], "the ranks feed the sampled token themselves"
    assert outputs[1].new_token_ids == request.output_token_ids[:1]
    assert request.num_output_placeholders == 1  # step 2's token
    assert request.num_sent_token_ids == len(request.all_token_ids)


@pytest.mark.parametrize(
    "limits",
    [
        {},  # plenty of room
        {"num_blocks": 12, "max_num_seqs": 4, "max_num_batched_tokens": 16},  # preemptions
        {"max_num_batched_tokens": 6, "long_prefill_token_threshold": 4},  # chunked prefills
    ],
)
def test_outputs_are_those_of_lockstep_scheduling(limits: dict[str, int]) -> None:
    lockstep, _, _ = _run(False, **limits)
    ahead, engine, executor = _run(True, **limits)
    assert ahead.tokens == lockstep.tokens and ahead.finished == lockstep.finished
    assert engine.make_stats().num_used_blocks == 0 and executor.reqs == {}
    if "num_blocks" in limits:
        assert engine.scheduler.num_preemptions > 0, "the case must preempt steps in flight"


def test_a_stop_found_one_step_late_drops_the_extra_token_and_frees_the_blocks() -> None:
    engine, executor = make_engine(async_scheduling=True)
    request = make_request(1, [10, 11, 12], eos_token_id=EOS, max_tokens=10)
    executor.scripts[request.request_id] = [5, EOS, 7, 8]
    engine.add_request(request)
    view = run_to_completion(engine)
    assert view.tokens[(1, 1)] == [5, EOS] and view.finished[(1, 1)] is FinishReason.STOP
    assert len(_handles_in(executor, request.req_handle)) == 3, "one step ran past the stop"
    assert engine.make_stats().num_used_blocks == 0
    assert executor.reqs == {}, "the ranks were told to drop it"


def test_steps_in_flight_never_run_a_request_past_max_tokens() -> None:
    engine, executor = make_engine(async_scheduling=True)
    request = make_request(1, [10, 11, 12], max_tokens=3, ignore_eos=True)
    engine.add_request(request)
    view = run_to_completion(engine)
    assert len(view.tokens[(1, 1)]) == 3 and view.finished[(1, 1)] is FinishReason.LENGTH
    assert len(_handles_in(executor, request.req_handle)) == 3  # the prefill and two decodes


def test_an_abort_while_its_step_is_in_flight_emits_nothing_more() -> None:
    engine, executor = make_engine(async_scheduling=True)
    _add(engine, executor, num_reqs=2, max_tokens=5)
    view = ClientView()
    view.absorb(engine.step())
    view.absorb(engine.step())
    engine.abort_requests(1, [1])
    view = run_to_completion(engine, view)
    assert len(view.tokens.get((1, 1), [])) <= 2 and (1, 1) not in view.finished
    assert (1, 2) in view.finished and executor.reqs == {}


def test_a_fault_loses_the_steps_in_flight_and_the_requests_are_computed_again() -> None:
    lockstep, _, _ = _run(False)
    engine, executor = make_engine(async_scheduling=True, can_recover=True)
    _add(engine, executor, num_reqs=6, max_tokens=7)
    executor.fail_at_step = 4
    view = ClientView()
    while engine.can_step:
        view.absorb(engine.step())
    assert engine.suspension is not None and not engine.scheduler.has_steps_in_flight
    assert all(r.num_output_placeholders == 0 for r in engine.scheduler.requests.values())
    new_executor = FakeExecutor(4, 64, feeds_sampled=True)
    new_executor.scripts = executor.scripts
    view.absorb(engine.resume(new_executor, 64))
    view = run_to_completion(engine, view)
    assert view.tokens == lockstep.tokens and view.finished == lockstep.finished
    assert new_executor.reqs == {}

"""LoRA in the engine core: at most max_loras adapters run at once, a request whose adapter
cannot join waits without blocking others, slots travel with the steps that change them
(columnar), adapters never share KV blocks, unloading lets requests in flight finish."""

from __future__ import annotations

from core_svc.engine.engine_core import EngineCore
from core_svc.lora import LoraRequest
from core_svc.request import Request
from core_svc.sched.scheduler_output import SchedulerOutput
from splitserve_contracts.output_types import ErrorKind, FinishReason
from tests.unit.core.fake_executor import (
    ClientView,
    FakeExecutor,
    make_engine,
    make_request,
    run_to_completion,
)

PROMPT = list(range(10, 22))


def adapter(lora_id: int) -> LoraRequest:
    return LoraRequest(lora_id, f"adapter-{lora_id}", f"/adapters/{lora_id}")


def lora_request(handle: int, lora_id: int, prompt: list[int] = PROMPT, **kw: int) -> Request:
    request = make_request(handle, prompt, **kw)
    request.lora = adapter(lora_id) if lora_id else None
    return request


def replay_slots(steps: list[SchedulerOutput], lora_of: dict[int, int], max_loras: int) -> None:
    """Apply each step's slot changes as a rank would, and check every scheduled request's
    adapter is in a slot and at most max_loras adapters run in a step."""
    slots = [0] * max_loras
    for step in steps:
        if step.lora_slots is not None:
            for slot, lora_id in zip(step.lora_slots.slots, step.lora_slots.lora_ids, strict=True):
                slots[slot] = lora_id
        for lora_id in step.free_lora_ids:
            slots = [0 if s == lora_id else s for s in slots]
        for new in step.scheduled_new_reqs:
            lora_of[new.req_handle] = new.lora_id
        handles = [r.req_handle for r in step.scheduled_new_reqs]
        running = {lora_of[h] for h in handles + step.scheduled_cached_reqs.req_handles}
        running.discard(0)
        assert running <= set(slots), f"step {step.step_id}: {running} not all in {slots}"
        assert len(running) <= max_loras


def test_adapters_beyond_max_loras_wait_without_blocking_others() -> None:
    engine, executor = make_engine(max_loras=2, max_num_seqs=8)
    for handle, lora_id in [(1, 1), (2, 2), (3, 3), (4, 0), (5, 1)]:
        engine.add_request(lora_request(handle, lora_id, max_tokens=3 if lora_id != 2 else 6))
    view = ClientView()
    view.absorb(engine.step())
    first = executor.seen[0]
    assert {r.req_handle: r.lora_id for r in first.scheduled_new_reqs} == {1: 1, 2: 2, 4: 0, 5: 1}
    assert first.lora_slots is not None
    assert (first.lora_slots.lora_ids, first.lora_slots.lora_paths) == (
        [1, 2],
        ["/adapters/1", "/adapters/2"],
    )
    view = run_to_completion(engine, view)
    assert all(view.finished[(1, h)] == FinishReason.LENGTH for h in range(1, 6))
    starts = {r.req_handle: s.step_id for s in executor.seen for r in s.scheduled_new_reqs}
    assert starts[3] == 4, "adapter 3 starts when adapter 1's requests (3 tokens) are done"
    changes = [s.step_id for s in executor.seen if s.lora_slots is not None]
    assert changes == [1, 4], "slots travel only with the steps that change them"
    replay_slots(executor.seen, {}, max_loras=2)


def test_adapters_and_the_base_model_never_share_cached_blocks() -> None:
    engine, executor = make_engine(max_loras=2)

    def cached_tokens(request: Request) -> int:
        engine.add_request(request)
        run_to_completion(engine)
        return request.num_cached_tokens

    assert cached_tokens(lora_request(1, 0)) == 0
    assert cached_tokens(lora_request(2, 1)) == 0, "the base model's blocks are not adapter 1's"
    assert cached_tokens(lora_request(3, 2)) == 0, "nor adapter 2's"
    assert cached_tokens(lora_request(4, 1)) == 8, "adapter 1's own blocks are"
    assert cached_tokens(lora_request(5, 0)) == 8
    renamed = lora_request(6, 0)
    renamed.lora = LoraRequest(7, "adapter-1", "/adapters/1")  # loaded again: a new id
    assert cached_tokens(renamed) == 0


def test_unloading_lets_requests_in_flight_finish_then_frees_the_adapter() -> None:
    engine, executor = make_engine(max_loras=1)
    engine.add_request(lora_request(1, 1, max_tokens=5))
    view = ClientView()
    for _ in range(2):
        view.absorb(engine.step())
    assert engine.retire_lora(1) == 1
    view = run_to_completion(engine, view)
    assert view.finished[(1, 1)] == FinishReason.LENGTH
    frees = [s.step_id for s in executor.seen if s.free_lora_ids]
    assert frees == [executor.seen[-1].step_id] and executor.seen[-1].free_lora_ids == [1]
    assert engine.retire_lora(2) == 0  # unused: freed with the next step
    engine.add_request(lora_request(2, 0, max_tokens=1))
    run_to_completion(engine)
    assert executor.seen[-2].free_lora_ids == [2]


def test_a_name_that_is_not_loaded_is_refused_alone() -> None:
    engine, _ = make_engine(max_loras=1)
    unknown = make_request(1, PROMPT)
    unknown.lora = LoraRequest(0, "missing", "")
    engine.add_request(unknown)
    engine.add_request(lora_request(2, 0))
    view = run_to_completion(engine)
    detail = view.details[(1, 1)][-1]
    assert detail.error_kind == ErrorKind.INVALID_REQUEST
    assert "'missing' is not loaded" in detail.error_message
    assert view.finished[(1, 2)] == FinishReason.LENGTH
    off, _ = make_engine()
    off.add_request(lora_request(3, 4))
    assert "LoRA is off" in run_to_completion(off).details[(1, 3)][-1].error_message


def test_new_ranks_get_the_slots_again_after_a_recovery() -> None:
    engine, executor = make_engine(max_loras=2, can_recover=True)
    engine.add_request(lora_request(1, 1, max_tokens=6))
    engine.add_request(lora_request(2, 2, max_tokens=6))
    view = ClientView()
    view.absorb(engine.step())
    engine.scheduler.requeue_all()  # the ranks were lost: their slots too
    replacement = FakeExecutor(4, 64)
    engine.resume(replacement, 64)
    run_to_completion(engine, view)
    again = replacement.seen[0]
    assert again.lora_slots is not None and sorted(again.lora_slots.lora_ids) == [1, 2]
    assert sorted(r.lora_id for r in again.scheduled_new_reqs) == [1, 2]
    assert isinstance(engine, EngineCore)

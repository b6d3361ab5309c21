"""The adaptive prefill chunk (core_svc/sched/prefill_policy.py), driven through EngineCore with the
FakeExecutor: chunk sizes by what runs and waits, a new arrival admitted into the very next
step under async scheduling, budgets respected, long prompts not starved, preemption intact."""

from __future__ import annotations

from core_svc.engine.engine_core import EngineCore
from core_svc.sched.prefill_policy import MAX_PENDING_TO_CHUNK, MIN_DECODES_TO_CHUNK, PrefillPolicy
from core_svc.sched.scheduler_config import SchedulerConfig
from core_svc.sched.scheduler_output import SchedulerOutput
from tests.unit.core.fake_executor import (
    ClientView,
    FakeExecutor,
    make_engine,
    make_request,
    run_to_completion,
)

CHUNK = 8


def scheduled(so: SchedulerOutput) -> dict[int, int]:
    """req_handle -> tokens scheduled in this step."""
    handles = [r.req_handle for r in so.scheduled_new_reqs] + so.scheduled_cached_reqs.req_handles
    return dict(zip(handles, so.num_scheduled_tokens, strict=True))


def step(engine: EngineCore, executor: FakeExecutor, view: ClientView) -> dict[int, int]:
    view.absorb(engine.step())
    return scheduled(executor.seen[-1])


def start_decoders(
    num_decoders: int,
    adaptive_prefill_chunk: int = CHUNK,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
) -> tuple[EngineCore, FakeExecutor, ClientView]:
    """An engine whose first step prefilled `num_decoders` short prompts (handles 1..n): from
    the next step on they decode."""
    engine, executor = make_engine(
        num_blocks=256,
        max_num_seqs=16,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        adaptive_prefill_chunk=adaptive_prefill_chunk,
    )
    for handle in range(1, num_decoders + 1):
        engine.add_request(make_request(handle, [handle] * 3, max_tokens=40, ignore_eos=True))
    view = ClientView()
    step(engine, executor, view)
    return engine, executor, view


def add_prompts(engine: EngineCore, first: int, num: int, length: int) -> None:
    for handle in range(first, first + num):
        prompt = list(range(100 * handle, 100 * handle + length))
        engine.add_request(make_request(handle, prompt, max_tokens=2, ignore_eos=True))


def test_a_light_load_computes_one_chunk_per_step_while_requests_decode() -> None:
    engine, executor, view = start_decoders(MIN_DECODES_TO_CHUNK)
    add_prompts(engine, 10, 1, 30)  # req_handle 4
    chunks = []
    for _ in range(4):
        per_request = step(engine, executor, view)
        assert [per_request[h] for h in (1, 2, 3)] == [1, 1, 1], "decodes keep flowing"
        chunks.append(per_request[4])
    assert chunks == [8, 8, 8, 6]
    assert len(view.tokens[(1, 10)]) == 1, "its first token came with the last chunk"


def test_without_the_adaptive_chunk_the_prompt_goes_whole() -> None:
    engine, executor, view = start_decoders(MIN_DECODES_TO_CHUNK, adaptive_prefill_chunk=0)
    add_prompts(engine, 10, 1, 30)
    assert step(engine, executor, view)[4] == 30


def test_few_decoders_leave_the_prompt_whole() -> None:
    engine, executor, view = start_decoders(MIN_DECODES_TO_CHUNK - 1)
    add_prompts(engine, 10, 1, 30)
    assert step(engine, executor, view)[MIN_DECODES_TO_CHUNK] == 30


def test_a_burst_of_prompts_gets_the_whole_budget() -> None:
    engine, executor, view = start_decoders(MIN_DECODES_TO_CHUNK)
    add_prompts(engine, 10, MAX_PENDING_TO_CHUNK + 1, 12)  # req_handles 4..7
    per_request = step(engine, executor, view)
    prompt_tokens = sum(per_request[h] for h in range(4, 8))
    assert prompt_tokens == 48 and sum(per_request.values()) <= 64
    assert prompt_tokens > CHUNK


def test_the_chunk_is_shared_by_pending_prompts_and_the_token_budget_holds() -> None:
    engine, executor, view = start_decoders(MIN_DECODES_TO_CHUNK, max_num_batched_tokens=16)
    add_prompts(engine, 10, 2, 12)  # req_handles 4, 5: two pending, a light load
    steps = [step(engine, executor, view) for _ in range(3)]
    assert all(sum(per_request.values()) <= 16 for per_request in steps)
    # 4's first chunk; its last 4 and 5's first 4 (one chunk between them); 4 decodes, 5's 8
    assert [(s.get(4, 0), s.get(5, 0)) for s in steps] == [(8, 0), (4, 4), (1, 8)]


def test_a_long_prompt_finishes_its_prefill_among_steady_decoders() -> None:
    engine, executor, view = start_decoders(MIN_DECODES_TO_CHUNK, max_model_len=512)
    add_prompts(engine, 10, 1, 200)
    chunks = []
    while (1, 10) not in view.tokens:
        chunks.append(step(engine, executor, view).get(4, 0))
    assert chunks == [CHUNK] * 25, "one full chunk every step until its first token"


def test_a_request_arriving_during_a_prefill_step_joins_the_very_next_step() -> None:
    """Async scheduling: with the adaptive chunk no step is built ahead of one that computes
    prompt tokens, so a request that arrives while it runs is in the next step; without, the
    next step was built before it arrived."""
    for chunk, expected_step in ((CHUNK, 2), (0, 3)):
        engine, executor = make_engine(async_scheduling=True, adaptive_prefill_chunk=chunk)
        engine.add_request(make_request(1, list(range(20)), max_tokens=6, ignore_eos=True))
        engine.step()  # step 1 (the prefill) is sent
        engine.step()  # adaptive: it is applied; off: step 2 is built ahead, then 1 applied
        engine.add_request(make_request(2, list(range(50, 60)), max_tokens=2, ignore_eos=True))
        while not any(2 in scheduled(so) for so in executor.seen):
            engine.step()
        first = next(so.step_id for so in executor.seen if 2 in scheduled(so))
        assert first == expected_step, f"adaptive_prefill_chunk={chunk}"
        run_to_completion(engine)


def test_decode_steps_are_still_scheduled_ahead() -> None:
    engine, executor = make_engine(async_scheduling=True, adaptive_prefill_chunk=CHUNK)
    engine.add_request(make_request(1, list(range(5)), max_tokens=6, ignore_eos=True))
    engine.step()
    engine.step()  # the prefill step is applied before the next is built
    assert len(executor.seen) == 1
    assert engine.step() == {}, "the decode step 2 is in flight: step 3 is built ahead"
    engine.step()
    assert len(executor.seen) == 3 and engine.num_steps_applied == 2


def test_preemption_under_the_adaptive_chunk_keeps_every_output() -> None:
    """Tight KV: requests are preempted and recomputed in adaptive chunks; the FakeExecutor
    checks every KV position it reads, and every request ends with all its tokens."""
    for is_async in (False, True):
        engine, executor = make_engine(
            num_blocks=20, max_num_seqs=6, async_scheduling=is_async, adaptive_prefill_chunk=3
        )
        for handle in range(1, 7):
            prompt = list(range(10 * handle, 10 * handle + 6 + handle))
            engine.add_request(make_request(handle, prompt, max_tokens=12, ignore_eos=True))
        view = run_to_completion(engine)
        assert engine.make_stats().num_preemptions >= 1
        assert all(len(view.tokens[(1, h)]) == 12 for h in range(1, 7))
        assert engine.make_stats().kv_cache_usage == 0.0


def test_a_pooling_model_keeps_scheduling_ahead() -> None:
    """Every step of a pooling model computes prompts: holding each would lose every overlap."""
    for is_pooling, may_schedule_ahead in ((False, False), (True, True)):
        policy = PrefillPolicy(SchedulerConfig.of(adaptive_prefill_chunk=64, is_pooling=is_pooling))
        policy.num_prefill_tokens = 100
        assert policy.may_schedule_ahead() is may_schedule_ahead
    decode_step = PrefillPolicy(SchedulerConfig.of(adaptive_prefill_chunk=64))
    decode_step.num_prefill_tokens = 0
    assert decode_step.may_schedule_ahead()


def test_the_adaptive_chunk_fits_a_whole_image_when_images_are_not_split() -> None:
    split = SchedulerConfig.of(adaptive_prefill_chunk=64, max_tokens_per_mm_item=100)
    assert PrefillPolicy(split).adaptive_chunk == 64
    whole = SchedulerConfig.of(
        adaptive_prefill_chunk=64, max_tokens_per_mm_item=100, disable_chunked_mm_input=True
    )
    assert PrefillPolicy(whole).adaptive_chunk == 100

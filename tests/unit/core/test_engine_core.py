"""EngineCore: aborts, refusals, executor failure, events, logprobs and stats."""

from __future__ import annotations

from typing import Any

import pytest

from core_svc.engine.engine_core import EngineCore
from core_svc.request import RequestStatus
from core_svc.sched.scheduler_output import SchedulerOutput
from splitserve_contracts.output_types import (
    EngineCoreEventType,
    ErrorKind,
    FinishReason,
    ModelRunnerOutput,
    StepStatus,
)
from tests.unit.core.fake_executor import (
    ClientView,
    FakeExecutor,
    make_engine,
    make_request,
    run_to_completion,
)


def used_blocks(engine: EngineCore) -> int:
    return engine.make_stats().num_used_blocks


def assert_idle(engine: EngineCore) -> None:
    stats = engine.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.num_used_blocks) == (0, 0, 0)
    assert stats.kv_cache_usage == 0.0
    assert engine.client_requests == {}


def test_abort_waiting_request_never_reaches_workers() -> None:
    engine, executor = make_engine(max_num_seqs=1)
    engine.add_request(make_request(1, [1, 2, 3], max_tokens=3))
    engine.add_request(make_request(2, [4, 5, 6], max_tokens=3))
    view = ClientView()
    view.absorb(engine.step())
    engine.abort_requests(1, [2])
    run_to_completion(engine, view)
    assert (1, 2) not in view.tokens and (1, 2) not in view.details
    handles = {h for so in executor.seen for h in so.finished_req_handles}
    assert handles == {1}
    assert_idle(engine)


def test_abort_mid_prefill_and_mid_decode_frees_blocks() -> None:
    engine, executor = make_engine(max_num_batched_tokens=8)
    engine.add_request(make_request(2, [1], max_tokens=50))
    engine.add_request(make_request(1, list(range(30)), max_tokens=5))
    view = ClientView()
    view.absorb(engine.step())
    view.absorb(engine.step())
    assert len(view.tokens[(1, 2)]) == 2
    assert engine.client_requests[1][1].num_computed_tokens == 14
    engine.abort_requests(1, [1, 2])
    assert_idle(engine)
    run_to_completion(engine, view)
    assert sorted(executor.seen[-1].finished_req_handles) == [1, 2]
    assert view.finished == {}


def test_the_aborting_client_gets_the_next_steps_stats_and_nothing_else() -> None:
    engine, _ = make_engine()
    engine.add_request(make_request(1, [1, 2, 3], client_id=2, max_tokens=50))
    assert engine.step()[2].scheduler_stats.num_running_reqs == 1  # type: ignore[union-attr]
    engine.abort_requests(2, [1])
    outputs = engine.step()
    assert list(outputs) == [2]
    assert outputs[2].request_handles == [] and outputs[2].details == []
    stats = outputs[2].scheduler_stats
    assert stats is not None and (stats.num_running_reqs, stats.num_used_blocks) == (0, 0)
    assert engine.step() == {}  # once


def test_abort_preempted_request_tells_the_workers() -> None:
    engine, executor = make_engine(num_blocks=7)
    engine.add_request(make_request(1, list(range(8)), max_tokens=8))
    engine.add_request(make_request(2, list(range(100, 108)), max_tokens=8))
    view = ClientView()
    while engine.make_stats().num_preemptions == 0:
        view.absorb(engine.step())
    victim = engine.client_requests[1][2]
    assert victim.status == RequestStatus.PREEMPTED
    engine.abort_requests(1, [2])
    run_to_completion(engine, view)
    assert 2 in {h for so in executor.seen for h in so.finished_req_handles}
    assert (1, 2) not in view.finished
    assert_idle(engine)


def test_abort_of_finished_or_unknown_handles_is_a_no_op() -> None:
    engine, _ = make_engine()
    engine.add_request(make_request(1, [1, 2], max_tokens=1))
    view = run_to_completion(engine)
    assert view.finished == {(1, 1): FinishReason.LENGTH}
    engine.abort_requests(1, [1, 99])
    engine.abort_requests(42, [1])
    engine.abort_client(42)
    assert not engine.has_work()
    assert_idle(engine)


def test_abort_client_stops_only_that_client() -> None:
    engine, _ = make_engine()
    for client_id in (1, 2):
        for handle in (1, 2):
            engine.add_request(make_request(handle, [handle, 7], client_id=client_id, max_tokens=4))
    view = ClientView()
    view.absorb(engine.step())
    engine.abort_client(1)
    run_to_completion(engine, view)
    assert set(view.finished) == {(2, 1), (2, 2)}
    assert len(view.tokens[(1, 1)]) == 1
    assert_idle(engine)


@pytest.mark.parametrize(
    ("prompt", "sampling", "message"),
    [
        ([], {}, "empty"),
        (list(range(16)), {}, "max_model_len"),
        (list(range(20)), {}, "max_model_len"),
        ([1, 2], {"max_tokens": 0}, "max_tokens"),
        ([1, 2], {"max_tokens": 14}, "KV cache"),
        ([1, 5000], {}, "prompt token id is outside the vocabulary"),
        ([1, 2], {"request_id": "x" * 300}, "request_id is longer"),
        ([1, 2], {"cache_salt": "s" * 300}, "cache_salt is longer"),
    ],
)
def test_invalid_requests_finish_with_error(
    prompt: list[int], sampling: dict[str, Any], message: str
) -> None:
    engine, executor = make_engine(
        max_model_len=16, num_blocks=4, block_size=4, vocab_size=4096
    )  # 12 slots
    engine.add_request(make_request(1, prompt, **sampling))
    assert engine.has_work()
    outputs = engine.step()
    (detail,) = outputs[1].details
    assert detail.finish_reason == FinishReason.ERROR
    assert detail.error_kind == ErrorKind.INVALID_REQUEST
    assert message in detail.error_message
    assert executor.seen == []
    assert not engine.has_work()


def test_stop_and_eos_ids_past_the_vocabulary_are_dropped_and_the_request_served() -> None:
    """A tokenizer's added EOS can lie past the model's rows (Qwen2Tokenizer's <|endoftext|>
    at id == config.vocab_size), as can a generation config's extra EOS the frontend adds to
    stop_token_ids: the model never samples them, so they never end a request (vLLM serves it).
    They are dropped, min_tokens included: the ranks, which index logits by the stop ids, see
    only those in the vocabulary. (A client's own out-of-vocabulary stop_token_ids are refused
    by the frontend: tests/unit/frontend/test_input_processor.py.)"""
    engine, executor = make_engine(vocab_size=4096)
    executor.scripts["req-1-1"] = [9, 7, 9]
    engine.add_request(
        make_request(1, [1, 2], eos_token_id=4096, stop_token_ids=(4096, 7, 9999), min_tokens=1)
    )
    engine.add_request(make_request(2, [1, 2], eos_token_id=9999, min_tokens=3, max_tokens=5))
    view = run_to_completion(engine)
    assert view.finished == {(1, 1): FinishReason.STOP, (1, 2): FinishReason.LENGTH}
    assert view.details[(1, 1)][-1].stop_token_id == 7
    assert view.tokens[(1, 1)] == [9, 7] and len(view.tokens[(1, 2)]) == 5
    sent = {new.req_handle: new for so in executor.seen for new in so.scheduled_new_reqs}
    assert sorted(new.stop_token_ids for new in sent.values()) == [(), (7,)]
    assert_idle(engine)


def test_duplicate_live_handle_is_refused_without_touching_the_original() -> None:
    engine, _ = make_engine()
    engine.add_request(make_request(1, [1, 2, 3], max_tokens=3))
    engine.add_request(make_request(1, [4, 5, 6], max_tokens=3))
    outputs = engine.step()
    errors = [d for d in outputs[1].details if d.finish_reason == FinishReason.ERROR]
    assert len(errors) == 1 and "already in use" in errors[0].error_message
    view = run_to_completion(engine)
    assert view.finished == {(1, 1): FinishReason.LENGTH}
    assert len(view.tokens[(1, 1)]) == 2


def test_executor_failure_fails_every_request_and_the_engine() -> None:
    engine, executor = make_engine()
    engine.add_request(make_request(1, [1, 2, 3], max_tokens=10))
    engine.add_request(make_request(2, [4, 5, 6], client_id=2, max_tokens=10))
    executor.fail_at_step = 3
    view = run_to_completion(engine)
    assert view.finished == {(1, 1): FinishReason.ERROR, (2, 2): FinishReason.ERROR}
    assert "rank 0 lost" in view.details[(1, 1)][-1].error_message
    assert engine.is_failed and "rank 0 lost" in engine.failure_message
    assert_idle(engine)
    steps = len(executor.seen)
    engine.add_request(make_request(3, [1, 2], max_tokens=2))
    outputs = engine.step()
    assert outputs[1].details[0].finish_reason == FinishReason.ERROR
    assert "engine failed" in outputs[1].details[0].error_message
    assert len(executor.seen) == steps


class ErrorStatusExecutor(FakeExecutor):
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return ModelRunnerOutput(
            step_id=scheduler_output.step_id, status=StepStatus.ERROR, error_message="CUDA OOM"
        )


def test_error_status_output_fails_the_engine() -> None:
    engine, _ = make_engine()
    engine.executor = ErrorStatusExecutor(4, 64)
    engine.add_request(make_request(1, [1, 2, 3]))
    outputs = engine.step()
    assert outputs[1].details[0].finish_reason == FinishReason.ERROR
    assert "CUDA OOM" in outputs[1].details[0].error_message
    assert engine.is_failed


class SilentExecutor(FakeExecutor):
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return ModelRunnerOutput(step_id=scheduler_output.step_id)


def test_missing_sampled_token_fails_the_request_instead_of_stalling() -> None:
    engine, _ = make_engine()
    engine.executor = SilentExecutor(4, 64)
    engine.add_request(make_request(1, [1, 2, 3]))
    outputs = engine.step()
    (detail,) = outputs[1].details
    assert detail.finish_reason == FinishReason.ERROR
    assert "sampled no token" in detail.error_message
    assert not engine.is_failed
    run_to_completion(engine)
    assert_idle(engine)


def test_events_first_token_facts_and_logprobs() -> None:
    engine, _ = make_engine()
    engine.add_request(
        make_request(1, [1, 2, 3, 4, 5], max_tokens=3, logprobs=0, prompt_logprobs=0)
    )
    view = run_to_completion(engine)
    details = view.details[(1, 1)]
    assert len(details) == 3, "logprobs ride in a detail with every token"
    first = details[0]
    assert [e.type for e in first.events] == [
        EngineCoreEventType.QUEUED,
        EngineCoreEventType.SCHEDULED,
    ]
    assert first.events[0].timestamp <= first.events[1].timestamp
    assert first.num_cached_tokens == 0
    assert first.prompt_logprobs is not None and first.prompt_logprobs.token_ids == [2, 3, 4, 5]
    assert all(d.new_logprobs is not None for d in details)
    assert details[1].events == [] and details[1].num_cached_tokens is None


def test_plain_decode_tokens_need_no_details() -> None:
    engine, _ = make_engine()
    engine.add_request(make_request(1, [1, 2, 3], max_tokens=4))
    view = run_to_completion(engine)
    assert len(view.tokens[(1, 1)]) == 4
    assert len(view.details[(1, 1)]) == 2  # the first token and the finish


def test_stats_are_cumulative() -> None:
    engine, executor = make_engine(num_blocks=33)
    engine.add_request(make_request(1, list(range(9)), max_tokens=4))
    engine.step()
    stats = engine.make_stats()
    assert stats.num_running_reqs == 1 and stats.num_waiting_reqs == 0
    assert stats.step_id == 1 and stats.num_scheduled_tokens == 9
    assert stats.num_used_blocks == 3 and stats.num_total_blocks == 32
    assert stats.kv_cache_usage == 3 / 32
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (9, 0)
    run_to_completion(engine)
    engine.add_request(make_request(2, list(range(9)), max_tokens=1))
    run_to_completion(engine)
    stats = engine.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (18, 8)
    assert stats.step_id == len(executor.seen)


def test_a_request_the_ranks_refuse_fails_alone() -> None:
    engine, executor = make_engine()
    executor.refuse["bad"] = "top_p must be in (0, 1], got 7"
    engine.add_request(make_request(1, [1, 2, 3], request_id="bad", max_tokens=3))
    engine.add_request(make_request(2, [4, 5, 6], request_id="good", max_tokens=3))
    view = run_to_completion(engine)
    assert view.finished == {(1, 1): FinishReason.ERROR, (1, 2): FinishReason.LENGTH}
    (detail,) = [d for d in view.details[(1, 1)] if d.finish_reason]
    assert detail.error_kind == ErrorKind.INVALID_REQUEST and "top_p" in detail.error_message
    assert len(view.tokens[(1, 2)]) == 3 and not engine.is_failed
    assert_idle(engine)


def test_sampled_ids_outside_the_vocabulary_fail_the_request_not_the_engine() -> None:
    engine, executor = make_engine(vocab_size=500)  # the fake samples ids in [100, 1100)
    engine.add_request(make_request(1, [1, 2, 3], max_tokens=20))
    view = run_to_completion(engine)
    (detail,) = [d for d in view.details[(1, 1)] if d.finish_reason]
    assert detail.error_kind == ErrorKind.ENGINE_FAILURE and "outside the vocabulary" in (
        detail.error_message
    )
    assert not engine.is_failed
    assert_idle(engine)


@pytest.mark.parametrize(
    ("limits", "prompt_len", "needle"),
    [
        ({"max_num_queued_reqs": 2}, 3, "--max-num-queued-reqs 2"),
        ({"max_num_queued_tokens": 8}, 3, "--max-num-queued-tokens 8"),
    ],
)
def test_a_full_queue_refuses_new_requests_at_once(
    limits: dict[str, int], prompt_len: int, needle: str
) -> None:
    engine, executor = make_engine(**limits)
    for handle in (1, 2, 3):
        engine.add_request(make_request(handle, list(range(1, prompt_len + 1)), max_tokens=2))
    outputs = engine.step()
    errors = [d for d in outputs[1].details if d.finish_reason == FinishReason.ERROR]
    assert [d.request_handle for d in errors] == [3]
    assert errors[0].error_kind == ErrorKind.OVERLOADED and needle in errors[0].error_message
    view = run_to_completion(engine)
    assert view.finished == {
        (1, 1): FinishReason.LENGTH,
        (1, 2): FinishReason.LENGTH,
    }
    engine.add_request(make_request(4, [1, 2, 3], max_tokens=2))  # room again once they ran
    assert run_to_completion(engine).finished == {(1, 4): FinishReason.LENGTH}


@pytest.mark.parametrize(
    ("limits", "prompt_len", "num_admitted"),
    [
        # 2 queued + max_num_seqs 4 running: what a core could have held
        ({"max_num_queued_reqs": 2}, 3, 6),
        # 8 queued tokens + the KV cache's 7 usable blocks x 4 tokens: 36 tokens, 3 prompts of 10
        ({"max_num_queued_tokens": 8}, 10, 3),
    ],
)
def test_resumed_requests_pass_the_queue_limits_within_a_bound(
    limits: dict[str, int], prompt_len: int, num_admitted: int
) -> None:
    """A frontend resubmits what an engine core admitted before its restart: those are not
    refused for a full queue, but the mark buys no more room than the engine could have held
    running (a peer that marks everything resumed gets that much, no more)."""
    engine, _ = make_engine(num_blocks=8, max_num_seqs=4, **limits)
    prompt = list(range(1, prompt_len + 1))
    for handle in range(1, num_admitted + 2):
        engine.add_request(make_request(handle, prompt, max_tokens=2, is_resumed=True))
    engine.add_request(make_request(100, [1, 2], max_tokens=2))  # a new one: the queue is full
    outputs = engine.step()
    refused = {d.request_handle: d for d in outputs[1].details if d.finish_reason}
    assert sorted(refused) == [num_admitted + 1, 100]
    assert all(d.error_kind == ErrorKind.OVERLOADED for d in refused.values())
    assert "even for a resumed request" in refused[num_admitted + 1].error_message
    finished = run_to_completion(engine).finished
    assert finished == {(1, h): FinishReason.LENGTH for h in range(1, num_admitted + 1)}

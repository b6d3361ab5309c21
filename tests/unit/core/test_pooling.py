"""Pooling requests in the engine core: prefill-only, pooled over the whole prompt however it is
chunked, never reading the prefix cache, finished with their vector and their blocks freed."""

from __future__ import annotations

import pytest

from core_svc.request import Request
from splitserve_contracts.output_types import ErrorKind, FinishReason
from tests.unit.core.fake_executor import (
    ClientView,
    make_engine,
    make_request,
    pooled_bytes,
    run_to_completion,
)


def pooling_request(handle: int, prompt: list[int], **kwargs: object) -> Request:
    return make_request(handle, prompt, max_tokens=1, pooling_task="embed", **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prompt_finishes_with_its_vector_and_frees_its_blocks(
    async_scheduling: bool,
) -> None:
    engine, executor = make_engine(
        max_num_batched_tokens=16, is_pooling=True, async_scheduling=async_scheduling
    )
    prompt = list(range(10, 50))
    engine.add_request(pooling_request(1, prompt))
    engine.add_request(pooling_request(2, [7, 8, 9]))
    view = run_to_completion(engine)
    assert view.finished == {(1, 1): FinishReason.STOP, (1, 2): FinishReason.STOP}
    assert view.tokens == {}  # nothing sampled, nothing streamed
    final = {h: view.details[(1, h)][-1] for h in (1, 2)}
    assert final[1].pooling_output == pooled_bytes(prompt)
    assert final[2].pooling_output == pooled_bytes([7, 8, 9])
    scheduled_1 = sum(
        n
        for so in executor.seen
        for h, n in zip(
            [r.req_handle for r in so.scheduled_new_reqs] + so.scheduled_cached_reqs.req_handles,
            so.num_scheduled_tokens,
            strict=True,
        )
        if h == 1
    )
    assert scheduled_1 == len(prompt)  # three chunks, no decode after them
    assert len(executor.seen) >= 3
    assert engine.make_stats().kv_cache_usage == 0.0
    assert not executor.reqs  # the ranks were told to drop both


def test_pooling_requests_never_read_the_prefix_cache() -> None:
    engine, executor = make_engine(is_pooling=True)
    prompt = list(range(100, 124))
    engine.add_request(pooling_request(1, prompt))
    view = run_to_completion(engine)
    engine.add_request(pooling_request(2, prompt))
    run_to_completion(engine, view)
    second = next(r for so in executor.seen for r in so.scheduled_new_reqs if r.req_handle == 2)
    assert second.num_computed_tokens == 0  # every position is pooled again
    assert view.details[(1, 2)][-1].pooling_output == pooled_bytes(prompt)


@pytest.mark.parametrize(
    ("is_pooling", "engine_request", "reason"),
    [
        (False, pooling_request(1, [1, 2, 3]), "takes no pooling requests"),
        (True, make_request(1, [1, 2, 3]), "only takes pooling requests"),
        (True, pooling_request(1, [1, 2], stop_token_ids=(5,)), "no stop token ids"),
        (True, make_request(1, [1, 2], max_tokens=1, pooling_task="token_classify"), "not one of"),
    ],
)
def test_mismatched_requests_are_refused_alone(
    is_pooling: bool, engine_request: Request, reason: str
) -> None:
    engine, _ = make_engine(is_pooling=is_pooling)
    engine.add_request(engine_request)
    view = ClientView()
    view.absorb(engine.step())
    detail = view.details[(1, 1)][-1]
    assert detail.finish_reason == FinishReason.ERROR
    assert detail.error_kind == ErrorKind.INVALID_REQUEST and reason in detail.error_message


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_encoder_only_prompts_run_whole_in_one_step(async_scheduling: bool) -> None:
    """An encoder-only model's prompt is never chunked (bidirectional attention): one that does
    not fit what is left of a step waits for the next, whatever long_prefill_token_threshold
    says; one longer than a step's budget is refused alone."""
    engine, executor = make_engine(
        max_num_batched_tokens=16,
        long_prefill_token_threshold=4,
        async_scheduling=async_scheduling,
        is_pooling=True,
        is_encoder_only=True,
    )
    prompts = {1: list(range(10, 22)), 2: list(range(30, 40)), 3: list(range(50, 67))}
    for handle, prompt in prompts.items():
        engine.add_request(pooling_request(handle, prompt))
    view = run_to_completion(engine)
    assert [list(so.num_scheduled_tokens) for so in executor.seen if so.num_scheduled_tokens] == [
        [12],
        [10],
    ]
    for handle in (1, 2):
        assert view.details[(1, handle)][-1].pooling_output == pooled_bytes(prompts[handle])
    refused = view.details[(1, 3)][-1]
    assert refused.error_kind == ErrorKind.INVALID_REQUEST
    assert "token budget (max_num_batched_tokens=16)" in refused.error_message
    assert engine.make_stats().kv_cache_usage == 0.0

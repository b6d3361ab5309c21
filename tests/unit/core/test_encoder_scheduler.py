"""The scheduler's multimodal side: encoder budget and encoder-cache accounting, chunks that never
end inside an image whose output cannot be cached, image-aware prefix-cache hashes, and the
multimodal checks of a request, driven through EngineCore with the FakeExecutor."""

from __future__ import annotations

import dataclasses

import pytest

from core_svc import convert
from core_svc.engine.engine_core import EngineCore
from core_svc.kv_cache.block_hash import BlockHasher
from core_svc.mm_inputs import MultiModalFeatureSpec
from core_svc.request import Request
from core_svc.sched.encoder_scheduler import EncoderScheduler
from core_svc.sched.scheduler_output import SchedulerOutput
from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.core.v1 import core_service_pb2 as core_pb2
from splitserve_contracts.output_types import FinishReason
from tests.fixtures.core_wire import scheduler_output_from_proto
from tests.unit.core.fake_executor import (
    ClientView,
    FakeExecutor,
    make_engine,
    make_request,
    run_to_completion,
)

ITEM = 12


def image(identifier: str, offset: int, length: int = ITEM) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(identifier, offset, length, identifier.encode())


def mm_request(
    handle: int, num_tokens: int, *features: MultiModalFeatureSpec, token: int = 0
) -> Request:
    request = make_request(handle, [token or 100 + handle] * num_tokens, max_tokens=2)
    request.mm_features = features
    return request


def mm_engine(**kwargs: int) -> tuple[EngineCore, FakeExecutor]:
    return make_engine(max_tokens_per_mm_item=ITEM, **kwargs)


def step(engine: EngineCore, executor: FakeExecutor, view: ClientView) -> SchedulerOutput:
    view.absorb(engine.step())
    return executor.seen[-1]


def cached_tokens(view: ClientView, handle: int) -> int | None:
    return next(
        d.num_cached_tokens for d in view.details[(1, handle)] if d.num_cached_tokens is not None
    )


def scheduled(so: SchedulerOutput) -> dict[int, int]:
    handles = [r.req_handle for r in so.scheduled_new_reqs] + so.scheduled_cached_reqs.req_handles
    return dict(zip(handles, so.num_scheduled_tokens, strict=True))


def test_a_chunk_ends_before_an_image_whose_output_cannot_be_cached() -> None:
    engine, executor = mm_engine(max_num_batched_tokens=16, long_prefill_token_threshold=8)
    view = ClientView()
    engine.add_request(mm_request(1, 20, image("x", 4)))
    engine.add_request(mm_request(2, 20, image("y", 4)))
    first = step(engine, executor, view)
    # 1 runs 8 tokens and encodes x (12 of the 16 encoder tokens); y does not fit: 2 stops
    # before its image instead of splitting it.
    assert scheduled(first) == {1: 8, 2: 4}
    assert first.scheduled_encoder_inputs == {1: [0]}
    second = step(engine, executor, view)
    # x is cached (1 still needs it); the cache has no room for y while 1 holds x.
    assert scheduled(second) == {1: 8}
    assert second.scheduled_encoder_inputs == {}
    third = step(engine, executor, view)
    # 1 computed past x: its entry is evicted for y, and the workers are told.
    assert third.scheduled_encoder_inputs == {2: [0]}
    assert third.free_encoder_mm_hashes == ["x"]
    assert scheduled(third)[2] == 8


def test_the_same_image_in_two_requests_is_encoded_once_and_counted_as_a_hit() -> None:
    engine, executor = mm_engine(enable_prefix_caching=False)
    view = ClientView()
    engine.add_request(mm_request(1, 20, image("x", 3)))
    engine.add_request(mm_request(2, 24, image("x", 7)))
    first = step(engine, executor, view)
    assert first.scheduled_encoder_inputs == {1: [0]}
    assert scheduled(first) == {1: 20, 2: 24}
    stats = engine.make_stats()
    assert (stats.encoder_cache_queries, stats.encoder_cache_hits) == (2, 1)
    run_to_completion(engine, view)
    assert set(view.finished.values()) == {FinishReason.LENGTH}


def test_disable_chunked_mm_input_never_splits_an_image() -> None:
    engine, executor = mm_engine(long_prefill_token_threshold=12, disable_chunked_mm_input=True)
    view = ClientView()
    engine.add_request(mm_request(1, 30, image("x", 5)))
    chunks = [scheduled(step(engine, executor, view))[1] for _ in range(3)]
    assert chunks == [5, 12, 12]  # stops at the image, then the image whole


def test_a_recompute_after_preemption_runs_the_encoder_again_once_the_entry_is_gone() -> None:
    encoder = EncoderScheduler(compute_budget=16, cache_size=16, disable_chunked_mm_input=False)
    first, other = mm_request(1, 20, image("x", 2)), mm_request(2, 20, image("y", 2))
    first.req_handle, other.req_handle = 1, 2
    encoder.begin_step()
    assert encoder.plan(first, 0, 16) == (16, [0])
    encoder.commit(first, [0])
    encoder.free(first)  # preempted: x stays cached, unreferenced
    encoder.begin_step()
    assert encoder.plan(other, 0, 16) == (16, [0])  # evicts x for y
    encoder.commit(other, [0])
    assert encoder.take_freed() == ["x"]
    encoder.free(other)
    encoder.begin_step()
    assert encoder.plan(first, 0, 16) == (16, [0])  # the kept features run again


def test_prefix_hashes_include_the_images() -> None:
    hasher = BlockHasher(block_size=4)
    tokens = [7] * 16

    def hashes(*features: MultiModalFeatureSpec) -> list[bytes]:
        out: list[bytes] = []
        hasher.extend(out, tokens, "", features)
        return out

    x, y, x_later = hashes(image("x", 6, 4)), hashes(image("y", 6, 4)), hashes(image("x", 7, 4))
    assert x == hashes(image("x", 6, 4))
    assert x[0] == y[0] and x[1] != y[1] and x[2:] != y[2:]  # from the image's first block on
    assert x[1] != x_later[1]  # the offset within the block counts too
    assert hashes()[0] == x[0]


def test_the_same_text_with_another_image_misses_the_prefix_cache() -> None:
    engine, executor = mm_engine(block_size=4)
    view = ClientView()
    engine.add_request(mm_request(1, 30, image("x", 8), token=7))
    view.absorb(engine.step())
    engine.add_request(mm_request(2, 30, image("x", 8), token=7))
    engine.add_request(mm_request(3, 30, image("y", 8), token=7))
    view.absorb(engine.step())
    assert cached_tokens(view, 2) == 28
    assert cached_tokens(view, 3) == 8  # the blocks before the image only


@pytest.mark.parametrize(
    "max_item, features, words",
    [
        (0, (image("x", 2),), "text only"),
        (ITEM, (image("x", 2), image("y", 10)), "overlap"),
        (ITEM, (image("x", 25),), "leave the prompt"),
        (ITEM, (image("x", 2, ITEM + 1),), "placeholder tokens"),
        (
            ITEM,
            (dataclasses.replace(image("x", 2), grid_thw=(1, 4, 4), num_patches=15),),
            "makes 16",
        ),
        (ITEM, (dataclasses.replace(image("x", 2), grid_thw=(4, 4), num_patches=16),), "three"),
    ],
)
def test_bad_multimodal_features_are_refused_alone(
    max_item: int, features: tuple[MultiModalFeatureSpec, ...], words: str
) -> None:
    engine, _ = make_engine(max_tokens_per_mm_item=max_item)
    view = ClientView()
    engine.add_request(mm_request(1, 30, *features))
    view.absorb(engine.step())
    assert view.finished[(1, 1)] == FinishReason.ERROR
    assert words in view.details[(1, 1)][-1].error_message


def test_features_travel_untouched_from_the_frontend_to_the_workers() -> None:
    msg = core_pb2.EngineCoreRequest(request_handle=5, prompt_token_ids=[1] * 20, max_tokens=2)
    feature = msg.mm_features.add(modality="image", identifier="abc", offset=3, length=4)
    feature.pixel_values.CopyFrom(
        types_pb2.TensorData(data=b"\x01" * 8, shape=[2, 1], dtype="float32")
    )
    feature.grid_thw.extend([1, 1, 2])
    request = convert.request_from_proto(msg, client_id=1)
    assert request.mm_features[0].grid_thw == (1, 1, 2)
    engine, executor = mm_engine()
    engine.add_request(request)
    engine.step()
    wire = convert.scheduler_output_to_proto(executor.seen[-1])
    assert list(wire.scheduled_new_reqs[0].mm_features) == [feature]
    assert [(e.req_handle, list(e.input_ids)) for e in wire.scheduled_encoder_inputs] == [
        (request.req_handle, [0])
    ]
    assert scheduler_output_from_proto(wire) == executor.seen[-1]


def test_after_a_rank_restart_the_new_ranks_encode_the_images_again() -> None:
    """The new ranks' encoder caches are empty: a resumed image request schedules its encoder
    input again, nothing is counted as cached and nothing is freed on ranks that never had it."""
    engine, executor = make_engine(max_tokens_per_mm_item=ITEM, can_recover=True)
    view = ClientView()
    engine.add_request(mm_request(1, 20, image("x", 3)))
    assert step(engine, executor, view).scheduled_encoder_inputs == {1: [0]}
    executor.fail_at_step = engine.scheduler.step_id + 1
    assert engine.step() == {} and engine.suspension is not None
    new_ranks = FakeExecutor(block_size=4, num_blocks=64)
    engine.resume(new_ranks, num_blocks=64)
    view.absorb(engine.step())
    first = new_ranks.seen[0]
    assert first.scheduled_encoder_inputs == {1: [0]} and first.free_encoder_mm_hashes == []
    run_to_completion(engine, view)
    assert set(view.finished.values()) == {FinishReason.LENGTH}

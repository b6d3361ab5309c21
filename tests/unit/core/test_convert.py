"""Protobuf <-> domain conversions of the engine core."""

from __future__ import annotations

import pytest

from core_svc import convert
from core_svc.kv_cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from core_svc.outputs import EngineCoreOutput, EngineCoreOutputs
from splitserve_contracts import output_convert
from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.core.v1 import core_service_pb2 as core_pb2
from splitserve_contracts.output_types import (
    EngineCoreEvent,
    EngineCoreEventType,
    FinishReason,
    LogprobsTable,
    ModelRunnerOutput,
    RequestLogprobs,
    SchedulerStats,
    StepStatus,
    StepTimings,
)
from splitserve_contracts.worker.v1 import worker_service_pb2 as worker_pb2
from tests.fixtures.core_wire import (
    engine_core_outputs_from_proto,
    kv_events_from_proto,
    scheduler_output_from_proto,
)
from tests.unit.core.fake_executor import make_engine, make_request


def test_request_from_proto() -> None:
    sampler = types_pb2.SamplerParams(temperature=0.5, top_k=7, logit_bias={3: 1.5})
    msg = core_pb2.EngineCoreRequest(
        request_id="abc", request_handle=42, prompt_token_ids=[1, 2, 3], eos_token_id=0,
        cache_salt="s", priority=-2, max_tokens=5, min_tokens=2, stop_token_ids=[7, 8],
        sampler_params=sampler,
    )  # fmt: skip
    request = convert.request_from_proto(msg, client_id=9, arrival_time=12.5)
    assert (request.client_id, request.client_handle, request.request_id) == (9, 42, "abc")
    assert request.prompt_token_ids == request.all_token_ids == [1, 2, 3]
    assert request.eos_token_id == 0 and request.stop_token_ids == (7, 8)
    assert request.all_stop_token_ids == {0, 7, 8} and request.min_tokens == 2
    assert (request.cache_salt, request.priority, request.arrival_time) == ("s", -2, 12.5)
    assert request.max_tokens == 5 and request.req_handle == -1
    assert types_pb2.SamplerParams.FromString(request.sampler_params) == sampler
    assert not request.skip_reading_prefix_cache
    msg.ClearField("eos_token_id")
    msg.sampler_params.prompt_logprobs = 0
    request = convert.request_from_proto(msg, client_id=9)
    assert request.eos_token_id is None and request.all_stop_token_ids == {7, 8}
    assert request.skip_reading_prefix_cache


def test_reasoning_end_token_id_reaches_the_grammar_state_and_is_checked() -> None:
    from core_svc.engine.request_checks import invalid_request_reason
    from core_svc.sched.scheduler_config import SchedulerConfig

    msg = core_pb2.EngineCoreRequest(
        request_id="r", request_handle=1, prompt_token_ids=[1, 2], max_tokens=4
    )
    msg.structured_outputs.regex = "[0-9]+"
    request = convert.request_from_proto(msg, client_id=1)
    assert request.structured_output is not None
    assert request.structured_output.reasoning_ended  # unset: the grammar starts at once
    msg.reasoning_end_token_id = 99
    request = convert.request_from_proto(msg, client_id=1)
    state = request.structured_output
    assert state is not None and state.reasoning_end_token_id == 99
    assert not state.reasoning_ended
    config = SchedulerConfig(max_model_len=64, vocab_size=100)
    assert invalid_request_reason(request, config) is None
    msg.reasoning_end_token_id = 100
    reason = invalid_request_reason(convert.request_from_proto(msg, client_id=1), config)
    assert reason is not None and "reasoning_end_token_id" in reason


def test_engine_core_outputs_round_trip() -> None:
    outputs = EngineCoreOutputs(
        request_handles=[3, 4], num_new_tokens=[1, 2], new_token_ids=[10, 11, 12],
        details=[
            EngineCoreOutput(
                request_handle=3, finish_reason=FinishReason.STOP, stop_token_id=0,
                new_logprobs=LogprobsTable(1, [10, 9], [-0.25, -2.0], [1]),
                prompt_logprobs=LogprobsTable(0, [5], [-1.0], [3]),
                events=[EngineCoreEvent(EngineCoreEventType.QUEUED, 1.5),
                        EngineCoreEvent(EngineCoreEventType.SCHEDULED, 2.5)],
                num_cached_tokens=0,
            ),
            EngineCoreOutput(request_handle=4, finish_reason=FinishReason.ERROR, error_message="x"),
        ],
        timestamp=123.25, step_id=7,
        scheduler_stats=SchedulerStats(1, 2, 0.5, 100, 40, 3, 7, 12, 8, 16),
    )  # fmt: skip
    wire = convert.engine_core_outputs_to_proto(outputs).SerializeToString()
    back = engine_core_outputs_from_proto(core_pb2.EngineCoreOutputs.FromString(wire))
    assert back == outputs


def test_a_stream_response_carries_the_outputs_and_the_kv_events() -> None:
    """Built in place; the outputs are present even when empty (a frontend tells outputs from
    events alone by the field's presence)."""
    stored = BlockStored([b"a" * 32, b"b" * 32], b"p" * 32, [1, 2, 3, 4], None)
    events: list[KVCacheEvent] = [stored, BlockRemoved([b"c" * 32]), AllBlocksCleared()]
    outputs = EngineCoreOutputs([3], [1], [10], step_id=2, kv_events=events)
    msg = core_pb2.EngineStreamResponse.FromString(
        convert.stream_response_to_proto(outputs).SerializeToString()
    )
    assert kv_events_from_proto(msg.kv_events) == events
    outputs.kv_events = None
    assert engine_core_outputs_from_proto(msg.outputs) == outputs
    empty = convert.stream_response_to_proto(EngineCoreOutputs())
    assert empty.HasField("outputs") and not empty.HasField("kv_events")


def test_scheduler_output_of_a_real_step_round_trips() -> None:
    engine, executor = make_engine(num_blocks=7)
    engine.add_request(make_request(1, list(range(8)), max_tokens=8, temperature=0.0, seed=3))
    engine.add_request(make_request(2, list(range(100, 108)), max_tokens=8, logit_bias={1: 2.0}))
    while engine.has_work():
        engine.step()
    assert any(so.scheduled_cached_reqs.resumed_req_handles for so in executor.seen)
    assert any(so.finished_req_handles for so in executor.seen)
    for so in executor.seen:
        wire = convert.scheduler_output_to_proto(so).SerializeToString()
        msg = worker_pb2.SchedulerOutput.FromString(wire)
        assert scheduler_output_from_proto(msg) == so


def test_model_runner_output_round_trip_and_error_status() -> None:
    output = ModelRunnerOutput(
        step_id=5, status=StepStatus.OK, req_handles=[1, 2], sampled_token_ids=[7, 8],
        logprobs=[RequestLogprobs(1, LogprobsTable(0, [7], [-0.5], [1]))],
        prompt_logprobs=[RequestLogprobs(2, LogprobsTable(0, [3, 4], [-1.0, -2.0], [2, 5]))],
        rank=3, timings=StepTimings(0.25, 0.5, 0.125, 1.0), num_used_kv_blocks=9,
        failed_req_handles=[4], failed_reasons=["bad seed"],
    )  # fmt: skip
    wire = output_convert.model_runner_output_to_proto(output).SerializeToString()
    msg = worker_pb2.ModelRunnerOutput.FromString(wire)
    assert msg.status == worker_pb2.STEP_STATUS_OK
    assert convert.model_runner_output_from_proto(msg) == output
    failed = worker_pb2.ModelRunnerOutput(step_id=5, status=worker_pb2.STEP_STATUS_ERROR, rank=1)
    assert convert.model_runner_output_from_proto(failed).error_message == "rank 1 failed step 5"
    failed.error_message = "CUDA error"
    assert convert.model_runner_output_from_proto(failed).error_message == "CUDA error"


def test_columns_that_do_not_line_up_are_refused() -> None:
    msg = worker_pb2.ModelRunnerOutput(step_id=5, status=worker_pb2.STEP_STATUS_OK, rank=1)
    msg.req_handles.extend([1, 2])
    msg.sampled_token_ids.append(7)
    with pytest.raises(ValueError, match="2 requests but 1 sampled tokens"):
        convert.model_runner_output_from_proto(msg)
    del msg.req_handles[1]
    msg.failed_reasons.append("why")
    with pytest.raises(ValueError, match="do not line up"):
        convert.model_runner_output_from_proto(msg)


def test_scheduler_stats_round_trip() -> None:
    stats = SchedulerStats(1, 2, 0.25, 100, 40, 3, 7, 12, 8, 16, 5, 4, 900, 60)
    msg = output_convert.scheduler_stats_to_proto(stats)
    assert msg.kv_cache_usage == 0.25 and msg.num_total_blocks == 16
    assert msg.num_prompt_tokens == 900 and msg.num_generation_tokens == 60
    assert output_convert.scheduler_stats_from_proto(msg) == stats


def test_an_enum_value_a_newer_peer_sends_reads_as_unspecified() -> None:
    msg = worker_pb2.ModelRunnerOutput(step_id=5, rank=1)
    msg.status = 7  # type: ignore[assignment]
    assert output_convert.model_runner_output_from_proto(msg).status == StepStatus.UNSPECIFIED

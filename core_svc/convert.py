"""Protobuf <-> domain conversions of the engine core; the only core module using *_pb2.

Repeated scalar fields are filled with `.extend()` of whole lists (packed encoding, one C
call per column) so a step with a thousand requests costs a handful of calls.
"""

from __future__ import annotations

from core_svc.mm_inputs import MultiModalFeatureSpec
from core_svc.outputs import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    ErrorKind,
    FinishReason,
    LogprobsTable,
    ModelRunnerOutput,
    SchedulerStats,
    StepTimings,
)
from core_svc.request import Request
from core_svc.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.core.v1 import core_service_pb2 as core_pb2
from splitserve_contracts.worker.v1 import worker_service_pb2 as worker_pb2


def request_from_proto(
    msg: core_pb2.EngineCoreRequest, client_id: int, arrival_time: float | None = None
) -> Request:
    """A new Request (no req_handle yet: EngineCore assigns it when the request is added). The
    sampler's settings stay serialized: the core only forwards them to the workers."""
    return Request(
        client_id=client_id,
        client_handle=msg.request_handle,
        request_id=msg.request_id,
        prompt_token_ids=list(msg.prompt_token_ids),
        output_token_ids=list(msg.output_token_ids),
        is_resumed=msg.resumed,
        max_tokens=msg.max_tokens,
        min_tokens=msg.min_tokens,
        stop_token_ids=tuple(msg.stop_token_ids),
        eos_token_id=msg.eos_token_id if msg.HasField("eos_token_id") else None,
        sampler_params=msg.sampler_params.SerializeToString(),
        skip_reading_prefix_cache=msg.sampler_params.HasField("prompt_logprobs"),
        cache_salt=msg.cache_salt,
        priority=msg.priority,
        arrival_time=arrival_time,
        mm_features=tuple(
            MultiModalFeatureSpec(f.identifier, f.offset, f.length, f.SerializeToString())
            for f in msg.mm_features
        ),
    )


def logprobs_table_to_proto(table: LogprobsTable, msg: types_pb2.LogprobsTable) -> None:
    msg.num_top_logprobs = table.num_top_logprobs
    msg.token_ids.extend(table.token_ids)
    msg.logprobs.extend(table.logprobs)
    msg.ranks.extend(table.ranks)


def logprobs_table_from_proto(msg: types_pb2.LogprobsTable) -> LogprobsTable:
    return LogprobsTable(
        num_top_logprobs=msg.num_top_logprobs,
        token_ids=list(msg.token_ids),
        logprobs=list(msg.logprobs),
        ranks=list(msg.ranks),
    )


def scheduler_stats_to_proto(
    stats: SchedulerStats, msg: core_pb2.SchedulerStats | None = None
) -> core_pb2.SchedulerStats:
    if msg is None:
        msg = core_pb2.SchedulerStats()
    msg.num_running_reqs = stats.num_running_reqs
    msg.num_waiting_reqs = stats.num_waiting_reqs
    msg.kv_cache_usage = stats.kv_cache_usage
    msg.prefix_cache_queries = stats.prefix_cache_queries
    msg.prefix_cache_hits = stats.prefix_cache_hits
    msg.num_preemptions = stats.num_preemptions
    msg.step_id = stats.step_id
    msg.num_scheduled_tokens = stats.num_scheduled_tokens
    msg.num_used_blocks = stats.num_used_blocks
    msg.num_total_blocks = stats.num_total_blocks
    msg.encoder_cache_queries = stats.encoder_cache_queries
    msg.encoder_cache_hits = stats.encoder_cache_hits
    return msg


def scheduler_stats_from_proto(msg: core_pb2.SchedulerStats) -> SchedulerStats:
    return SchedulerStats(
        num_running_reqs=msg.num_running_reqs,
        num_waiting_reqs=msg.num_waiting_reqs,
        kv_cache_usage=msg.kv_cache_usage,
        prefix_cache_queries=msg.prefix_cache_queries,
        prefix_cache_hits=msg.prefix_cache_hits,
        num_preemptions=msg.num_preemptions,
        step_id=msg.step_id,
        num_scheduled_tokens=msg.num_scheduled_tokens,
        num_used_blocks=msg.num_used_blocks,
        num_total_blocks=msg.num_total_blocks,
        encoder_cache_queries=msg.encoder_cache_queries,
        encoder_cache_hits=msg.encoder_cache_hits,
    )


def _detail_to_proto(detail: EngineCoreOutput, msg: core_pb2.EngineCoreOutput) -> None:
    msg.request_handle = detail.request_handle
    if detail.finish_reason is not None:
        msg.finish_reason = types_pb2.FinishReason.ValueType(detail.finish_reason)
    if detail.stop_token_id is not None:
        msg.stop_token_id = detail.stop_token_id
    if detail.new_logprobs is not None:
        logprobs_table_to_proto(detail.new_logprobs, msg.new_logprobs)
    if detail.prompt_logprobs is not None:
        logprobs_table_to_proto(detail.prompt_logprobs, msg.prompt_logprobs)
    for event in detail.events:
        event_msg = msg.events.add()
        event_msg.type = core_pb2.EngineCoreEventType.ValueType(event.type)
        event_msg.timestamp = event.timestamp
    if detail.num_cached_tokens is not None:
        msg.num_cached_tokens = detail.num_cached_tokens
    msg.error_message = detail.error_message
    msg.error_kind = core_pb2.ErrorKind.ValueType(detail.error_kind)


def engine_core_outputs_to_proto(outputs: EngineCoreOutputs) -> core_pb2.EngineCoreOutputs:
    msg = core_pb2.EngineCoreOutputs()
    msg.request_handles.extend(outputs.request_handles)
    msg.num_new_tokens.extend(outputs.num_new_tokens)
    msg.new_token_ids.extend(outputs.new_token_ids)
    for detail in outputs.details:
        _detail_to_proto(detail, msg.details.add())
    msg.timestamp = outputs.timestamp
    msg.step_id = outputs.step_id
    if outputs.scheduler_stats is not None:
        scheduler_stats_to_proto(outputs.scheduler_stats, msg.scheduler_stats)
    return msg


def _detail_from_proto(msg: core_pb2.EngineCoreOutput) -> EngineCoreOutput:
    has = msg.HasField
    return EngineCoreOutput(
        request_handle=msg.request_handle,
        finish_reason=FinishReason(msg.finish_reason) if msg.finish_reason else None,
        stop_token_id=msg.stop_token_id if has("stop_token_id") else None,
        new_logprobs=logprobs_table_from_proto(msg.new_logprobs) if has("new_logprobs") else None,
        prompt_logprobs=(
            logprobs_table_from_proto(msg.prompt_logprobs) if has("prompt_logprobs") else None
        ),
        events=[EngineCoreEvent(EngineCoreEventType(e.type), e.timestamp) for e in msg.events],
        num_cached_tokens=msg.num_cached_tokens if has("num_cached_tokens") else None,
        error_message=msg.error_message,
        error_kind=ErrorKind(msg.error_kind),
    )


def engine_core_outputs_from_proto(msg: core_pb2.EngineCoreOutputs) -> EngineCoreOutputs:
    """The inverse of engine_core_outputs_to_proto (for tests and in-process clients)."""
    return EngineCoreOutputs(
        request_handles=list(msg.request_handles),
        num_new_tokens=list(msg.num_new_tokens),
        new_token_ids=list(msg.new_token_ids),
        details=[_detail_from_proto(d) for d in msg.details],
        timestamp=msg.timestamp,
        step_id=msg.step_id,
        scheduler_stats=(
            scheduler_stats_from_proto(msg.scheduler_stats)
            if msg.HasField("scheduler_stats")
            else None
        ),
    )


def scheduler_output_to_proto(output: SchedulerOutput) -> worker_pb2.SchedulerOutput:
    msg = worker_pb2.SchedulerOutput(
        step_id=output.step_id, total_num_scheduled_tokens=output.total_num_scheduled_tokens
    )
    for new_req in output.scheduled_new_reqs:
        new_msg = msg.scheduled_new_reqs.add(
            req_handle=new_req.req_handle,
            request_id=new_req.request_id,
            num_computed_tokens=new_req.num_computed_tokens,
        )
        new_msg.prompt_token_ids.extend(new_req.prompt_token_ids)
        new_msg.sampler_params.MergeFromString(new_req.sampler_params)
        new_msg.block_ids.extend(new_req.block_ids)
        new_msg.stop_token_ids.extend(new_req.stop_token_ids)
        new_msg.min_tokens = new_req.min_tokens
        for feature in new_req.mm_features:
            new_msg.mm_features.add().MergeFromString(feature)
        if new_req.output_token_ids:
            new_msg.output_token_ids.extend(new_req.output_token_ids)
    cached, cached_msg = output.scheduled_cached_reqs, msg.scheduled_cached_reqs
    cached_msg.req_handles.extend(cached.req_handles)
    cached_msg.num_computed_tokens.extend(cached.num_computed_tokens)
    cached_msg.num_new_block_ids.extend(cached.num_new_block_ids)
    cached_msg.new_block_ids.extend(cached.new_block_ids)
    cached_msg.num_new_token_ids.extend(cached.num_new_token_ids)
    cached_msg.new_token_ids.extend(cached.new_token_ids)
    cached_msg.resumed_req_handles.extend(cached.resumed_req_handles)
    cached_msg.num_resumed_token_ids.extend(cached.num_resumed_token_ids)
    cached_msg.resumed_all_token_ids.extend(cached.resumed_all_token_ids)
    msg.num_scheduled_tokens.extend(output.num_scheduled_tokens)
    msg.finished_req_handles.extend(output.finished_req_handles)
    for handle, input_ids in output.scheduled_encoder_inputs.items():
        msg.scheduled_encoder_inputs.add(req_handle=handle, input_ids=input_ids)
    msg.free_encoder_mm_hashes.extend(output.free_encoder_mm_hashes)
    return msg


def scheduler_output_from_proto(msg: worker_pb2.SchedulerOutput) -> SchedulerOutput:
    """The inverse of scheduler_output_to_proto (for tests and fake workers)."""
    new_reqs = [
        NewRequestData(
            req_handle=r.req_handle,
            request_id=r.request_id,
            prompt_token_ids=list(r.prompt_token_ids),
            sampler_params=r.sampler_params.SerializeToString(),
            block_ids=list(r.block_ids),
            num_computed_tokens=r.num_computed_tokens,
            stop_token_ids=tuple(r.stop_token_ids),
            min_tokens=r.min_tokens,
            mm_features=[f.SerializeToString() for f in r.mm_features],
            output_token_ids=list(r.output_token_ids),
        )
        for r in msg.scheduled_new_reqs
    ]
    c = msg.scheduled_cached_reqs
    cached = CachedRequestData(
        req_handles=list(c.req_handles),
        num_computed_tokens=list(c.num_computed_tokens),
        num_new_block_ids=list(c.num_new_block_ids),
        new_block_ids=list(c.new_block_ids),
        num_new_token_ids=list(c.num_new_token_ids),
        new_token_ids=list(c.new_token_ids),
        resumed_req_handles=list(c.resumed_req_handles),
        num_resumed_token_ids=list(c.num_resumed_token_ids),
        resumed_all_token_ids=list(c.resumed_all_token_ids),
    )
    return SchedulerOutput(
        step_id=msg.step_id,
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=list(msg.num_scheduled_tokens),
        total_num_scheduled_tokens=msg.total_num_scheduled_tokens,
        finished_req_handles=list(msg.finished_req_handles),
        scheduled_encoder_inputs={
            e.req_handle: list(e.input_ids) for e in msg.scheduled_encoder_inputs
        },
        free_encoder_mm_hashes=list(msg.free_encoder_mm_hashes),
    )


def model_runner_output_from_proto(msg: worker_pb2.ModelRunnerOutput) -> ModelRunnerOutput:
    """A STEP_STATUS_ERROR output comes back with `error_message` set (never None), and the
    caller decides; its token columns are then meaningless. Columns that do not line up raise
    ValueError (a rank that answers that way cannot be trusted with the step)."""
    error_message = None
    if msg.status == worker_pb2.STEP_STATUS_ERROR:
        error_message = msg.error_message or f"rank {msg.rank} failed step {msg.step_id}"
    elif len(msg.req_handles) != len(msg.sampled_token_ids):
        raise ValueError(
            f"rank {msg.rank} answered step {msg.step_id} with {len(msg.req_handles)} requests "
            f"but {len(msg.sampled_token_ids)} sampled tokens"
        )
    if len(msg.failed_req_handles) != len(msg.failed_reasons):
        raise ValueError(f"rank {msg.rank}: failed requests and reasons do not line up")
    timings = None
    if msg.HasField("timings"):
        t = msg.timings
        timings = StepTimings(
            t.prepare_inputs_seconds, t.forward_seconds, t.sample_seconds, t.total_seconds
        )
    return ModelRunnerOutput(
        step_id=msg.step_id,
        req_handles=list(msg.req_handles),
        sampled_token_ids=list(msg.sampled_token_ids),
        logprobs={e.req_handle: logprobs_table_from_proto(e.table) for e in msg.logprobs},
        prompt_logprobs={
            e.req_handle: logprobs_table_from_proto(e.table) for e in msg.prompt_logprobs
        },
        error_message=error_message,
        rank=msg.rank,
        timings=timings,
        num_used_kv_blocks=msg.num_used_kv_blocks,
        failed_reqs=dict(zip(msg.failed_req_handles, msg.failed_reasons, strict=True)),
    )


def model_runner_output_to_proto(output: ModelRunnerOutput) -> worker_pb2.ModelRunnerOutput:
    """The inverse of model_runner_output_from_proto (for tests and fake workers)."""
    msg = worker_pb2.ModelRunnerOutput(
        step_id=output.step_id,
        status=worker_pb2.STEP_STATUS_OK
        if output.error_message is None
        else worker_pb2.STEP_STATUS_ERROR,
        error_message=output.error_message or "",
        rank=output.rank,
        num_used_kv_blocks=output.num_used_kv_blocks,
    )
    msg.req_handles.extend(output.req_handles)
    msg.sampled_token_ids.extend(output.sampled_token_ids)
    msg.failed_req_handles.extend(output.failed_reqs)
    msg.failed_reasons.extend(output.failed_reqs.values())
    for req_handle, table in output.logprobs.items():
        entry = msg.logprobs.add(req_handle=req_handle)
        logprobs_table_to_proto(table, entry.table)
    for req_handle, table in output.prompt_logprobs.items():
        entry = msg.prompt_logprobs.add(req_handle=req_handle)
        logprobs_table_to_proto(table, entry.table)
    if output.timings is not None:
        t = output.timings
        msg.timings.prepare_inputs_seconds = t.prepare_inputs_seconds
        msg.timings.forward_seconds = t.forward_seconds
        msg.timings.sample_seconds = t.sample_seconds
        msg.timings.total_seconds = t.total_seconds
    return msg

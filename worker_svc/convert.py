"""Protobuf <-> the worker's own types; with server.py, the only module that sees `*_pb2`.

Repeated integer fields are copied column-wise into numpy arrays (one C-level pass each),
and outputs go back through `extend(array.tolist())`, so a step costs a handful of bulk copies
rather than Python work per token.
"""

from __future__ import annotations

import numpy as np
from google.protobuf.internal.containers import RepeatedScalarFieldContainer

from splitserve_contracts import engine_options_convert, output_convert, sampling_convert
from splitserve_contracts.common.v1 import types_pb2 as common_pb2
from splitserve_contracts.output_types import ModelRunnerOutput
from splitserve_contracts.sampling_types import SamplerParams
from splitserve_contracts.worker.v1 import worker_service_pb2 as pb
from splitserve_runtime import engine_option_rules
from splitserve_runtime.tracing import TraceContext, trace_context
from worker_svc.lora.adapter import LoraAdapter
from worker_svc.model_loader.model_load import LoadedModel, LoadModelConfig, WorkerDescription
from worker_svc.runner.kv_cache import KvCapacity
from worker_svc.sample.grammar_bitmask import (
    grammar_bitmask_from_bytes,
    grammar_bitmask_from_sparse,
)
from worker_svc.scheduler_output import (
    CachedRequestData,
    GrammarBitmask,
    IntArray,
    LoraSlots,
    MultiModalInput,
    NewRequestData,
    SchedulerOutput,
)
from worker_svc.step_checks import MalformedStep


def _column(field: RepeatedScalarFieldContainer[int]) -> IntArray:
    return np.array(list(field), dtype=np.int64)


# -- requests ----------------------------------------------------------------------------------


def _trace(msg: common_pb2.TraceContext) -> TraceContext | None:
    """A request's trace context; a malformed or unsampled one is ignored (W3C)."""
    try:
        context = trace_context(msg.traceparent, msg.tracestate)
    except ValueError:
        return None
    return context if context is not None and context.is_sampled else None


def new_request_from_proto(req: pb.NewRequestData) -> NewRequestData:
    return NewRequestData(
        req_handle=req.req_handle,
        request_id=req.request_id,
        prompt_token_ids=_column(req.prompt_token_ids),
        sampling=sampling_convert.from_proto(req.sampler_params, SamplerParams),
        block_ids=_column(req.block_ids),
        num_computed_tokens=req.num_computed_tokens,
        stop_token_ids=_column(req.stop_token_ids),
        min_tokens=req.min_tokens,
        mm_features=tuple(
            MultiModalInput(
                identifier=f.identifier,
                offset=f.offset,
                length=f.length,
                data=f.pixel_values.data,
                shape=tuple(f.pixel_values.shape),
                dtype=f.pixel_values.dtype,
                grid_thw=tuple(f.grid_thw),
            )
            for f in req.mm_features
        ),
        output_token_ids=_column(req.output_token_ids),
        lora_id=req.lora_id,
        trace=_trace(req.trace_context),
        pooling_task=req.pooling_params.task if req.HasField("pooling_params") else "",
        state_slot=req.state_slot,
    )


def cached_requests_from_proto(cached: pb.CachedRequestData) -> CachedRequestData:
    return CachedRequestData(
        req_handles=_column(cached.req_handles),
        num_computed_tokens=_column(cached.num_computed_tokens),
        num_new_block_ids=_column(cached.num_new_block_ids),
        new_block_ids=_column(cached.new_block_ids),
        num_new_token_ids=_column(cached.num_new_token_ids),
        new_token_ids=_column(cached.new_token_ids),
        resumed_req_handles=_column(cached.resumed_req_handles),
        num_resumed_token_ids=_column(cached.num_resumed_token_ids),
        resumed_all_token_ids=_column(cached.resumed_all_token_ids),
        resumed_state_slots=_column(cached.resumed_state_slots),
    )


def scheduler_output_from_proto(msg: pb.SchedulerOutput) -> SchedulerOutput:
    return SchedulerOutput(
        step_id=msg.step_id,
        scheduled_new_reqs=[new_request_from_proto(r) for r in msg.scheduled_new_reqs],
        scheduled_cached_reqs=cached_requests_from_proto(msg.scheduled_cached_reqs),
        num_scheduled_tokens=_column(msg.num_scheduled_tokens),
        total_num_scheduled_tokens=msg.total_num_scheduled_tokens,
        finished_req_handles=_column(msg.finished_req_handles),
        scheduled_encoder_inputs={
            e.req_handle: list(e.input_ids) for e in msg.scheduled_encoder_inputs
        },
        free_encoder_mm_hashes=tuple(msg.free_encoder_mm_hashes),
        grammar_bitmask=grammar_bitmask_from_proto(msg.grammar_bitmask),
        has_pending_grammar=msg.has_pending_grammar,
        num_spec_tokens=_column(msg.num_spec_tokens),
        lora_slots=lora_slots_from_proto(msg.lora_slots) if msg.HasField("lora_slots") else None,
        free_lora_ids=tuple(msg.free_lora_ids),
        kv_connector_metadata=msg.kv_connector_metadata,
    )


def lora_slots_from_proto(msg: pb.LoraSlots) -> LoraSlots:
    """A step's LoRA slot changes; MalformedStep when the columns do not line up."""
    if not len(msg.slots) == len(msg.lora_ids) == len(msg.lora_paths):
        raise MalformedStep(
            f"lora_slots has {len(msg.slots)} slots, {len(msg.lora_ids)} lora_ids and "
            f"{len(msg.lora_paths)} lora_paths; they must line up"
        )
    return LoraSlots(tuple(msg.slots), tuple(msg.lora_ids), tuple(msg.lora_paths))


def grammar_bitmask_from_proto(msg: pb.GrammarBitmask) -> GrammarBitmask | None:
    """The step's token masks, or None (no constrained request samples); MalformedStep when
    the blob does not split into one row per request, or the sparse form does not line up."""
    if not msg.HasField("sparse"):
        return grammar_bitmask_from_bytes(list(msg.req_handles), msg.bitmask)
    if msg.bitmask:
        raise MalformedStep("grammar_bitmask has both bitmask and sparse; one form at a time")
    sparse = msg.sparse
    return grammar_bitmask_from_sparse(
        list(msg.req_handles),
        sparse.num_words,
        sparse.row_defaults,
        list(sparse.num_listed_words),
        sparse.word_indices,
        sparse.words,
    )


def load_model_config_from_proto(req: pb.LoadModelRequest) -> LoadModelConfig:
    """Decode and validate (splitserve_runtime/engine_option_rules.py, the rules the core's
    flags follow too); ValueError names the offending field."""
    options = engine_option_rules.validate(engine_options_convert.from_proto(req.options))
    return LoadModelConfig(options, rank=req.rank, rendezvous_id=req.rendezvous_id)


def lora_adapter_to_proto(adapter: LoraAdapter) -> pb.LoadLoraAdapterResponse:
    return pb.LoadLoraAdapterResponse(
        max_rank=adapter.max_rank,
        target_modules=list(adapter.target_modules),
        weight_bytes=adapter.nbytes,
        load_seconds=adapter.load_seconds,
    )


# -- responses ---------------------------------------------------------------------------------


def description_to_proto(d: WorkerDescription) -> pb.DescribeResponse:
    return pb.DescribeResponse(
        device_type=d.device_type,
        device_name=d.device_name,
        total_memory_bytes=d.total_memory_bytes,
        free_memory_bytes=d.free_memory_bytes,
        hostname=d.hostname,
        pid=d.pid,
        torch_version=d.torch_version,
        attention_backends=d.attention_backends,
    )


def loaded_model_to_proto(m: LoadedModel) -> pb.LoadModelResponse:
    return pb.LoadModelResponse(
        architecture=m.architecture,
        vocab_size=m.vocab_size,
        max_model_len=m.max_model_len,
        dtype=m.dtype,
        weight_bytes=m.weight_bytes,
        load_seconds=m.load_seconds,
        attention_backend=m.attention_backend,
        num_layers=m.num_layers,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        max_tokens_per_mm_item=m.max_tokens_per_mm_item,
        sliding_window=m.sliding_window,
        pooler_config=output_convert.pooler_config_to_proto(m.pooler_config)
        if m.pooler_config is not None
        else None,
    )


def kv_capacity_to_proto(c: KvCapacity) -> pb.GetKvCapacityResponse:
    return pb.GetKvCapacityResponse(
        available_bytes=c.available_bytes,
        bytes_per_block=c.bytes_per_block,
        num_blocks=c.num_blocks,
        num_state_slots=c.num_state_slots,
        bytes_per_state_slot=c.bytes_per_state_slot,
    )


def model_runner_output_to_proto(out: ModelRunnerOutput) -> pb.ModelRunnerOutput:
    return output_convert.model_runner_output_to_proto(out)


def error_output_to_proto(step_id: int, rank: int, message: str) -> pb.ModelRunnerOutput:
    return pb.ModelRunnerOutput(
        step_id=step_id, status=pb.STEP_STATUS_ERROR, error_message=message, rank=rank
    )

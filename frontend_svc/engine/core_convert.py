"""Where protobuf stops on the core side: the engine core's contract (its stream, outputs,
KV-cache events, info and stats) <-> the frontend's own types."""

from __future__ import annotations

import itertools

from frontend_svc.engine.engine_types import (
    CoreOutputDetail,
    CoreOutputs,
    EngineInfo,
    EngineSnapshot,
    HistogramState,
    LoraAdapterInfo,
    TokenizerInfo,
)
from frontend_svc.kv_events.hub import (
    AllBlocksCleared,
    BlockExtraKeys,
    BlocksRemoved,
    BlocksStored,
    KvEvent,
    KvEvents,
)
from frontend_svc.requests import EngineRequest
from splitserve_contracts import engine_info, sampling_convert, structured_outputs
from splitserve_contracts.core.v1 import core_service_pb2 as core_pb2
from splitserve_contracts.output_convert import (
    engine_core_event_from_proto,
    enum_member,
    logprobs_table_from_proto,
    pooler_config_from_proto,
    scheduler_stats_from_proto,
)
from splitserve_contracts.output_types import ErrorKind, FinishReason


def tokenizer_info_to_proto(info: TokenizerInfo) -> core_pb2.EngineStreamRequest:
    """The stream's first message: the tokenizer the core compiles grammars with."""
    msg = core_pb2.EngineStreamRequest()
    msg.tokenizer.tokenizer_json = info.tokenizer_json
    msg.tokenizer.eos_token_ids.extend(info.eos_token_ids)
    return msg


def coalesce(batch: list[core_pb2.EngineStreamRequest]) -> list[core_pb2.EngineStreamRequest]:
    """Merge runs of adds (or of aborts) into one message each, keeping their order."""
    merged: list[core_pb2.EngineStreamRequest] = []
    for msg in batch:
        kind = msg.WhichOneof("payload")
        last = merged[-1] if merged else None
        if last is not None and last.WhichOneof("payload") == kind == "add":
            last.add.requests.extend(msg.add.requests)
        elif last is not None and last.WhichOneof("payload") == kind == "abort":
            last.abort.request_handles.extend(msg.abort.request_handles)
        else:
            merged.append(msg)
    return merged


def engine_request_to_proto(handle: int, req: EngineRequest) -> core_pb2.EngineCoreRequest:
    """The engine core reads the stop conditions; the sampler's part of the params travels
    in sampler_params, copied field by field (same names) from SamplingParams."""
    params = req.params
    assert params.max_tokens is not None, "InputProcessor resolves max_tokens"
    msg = core_pb2.EngineCoreRequest(
        request_id=req.request_id,
        request_handle=handle,
        prompt_token_ids=req.prompt_token_ids,
        cache_salt=req.cache_salt,
        priority=req.priority,
        max_tokens=0 if req.pooling_task else params.max_tokens,
        min_tokens=params.min_tokens,
        stop_token_ids=params.stop_token_ids,
    )
    if req.pooling_task:
        msg.pooling_params.task = req.pooling_task
    if req.eos_token_id is not None:
        msg.eos_token_id = req.eos_token_id
    if req.output_token_ids:
        msg.output_token_ids.extend(req.output_token_ids)
    msg.resumed = req.is_resumed
    msg.lora_name = req.lora_name
    msg.kv_transfer_params_json = req.kv_transfer_params_json
    if req.trace is not None:
        msg.trace_context.traceparent = req.trace.traceparent
        msg.trace_context.tracestate = req.trace.tracestate
    sampling_convert.to_proto(params, msg.sampler_params)
    if req.structured_outputs is not None:
        structured_outputs.to_proto(req.structured_outputs, msg.structured_outputs)
        if req.reasoning_end_token_id is not None:
            msg.reasoning_end_token_id = req.reasoning_end_token_id
    for feature in req.mm_features:
        entry = msg.mm_features.add(
            modality=feature.modality,
            identifier=feature.identifier,
            offset=feature.offset,
            length=feature.length,
        )
        entry.pixel_values.data = feature.data
        entry.pixel_values.shape.extend(feature.shape)
        entry.pixel_values.dtype = feature.dtype
        entry.grid_thw.extend(feature.grid_thw)
    return msg


def _detail_from_proto(d: core_pb2.EngineCoreOutput) -> CoreOutputDetail:
    has = d.HasField
    return CoreOutputDetail(
        handle=d.request_handle,
        finish_reason=enum_member(FinishReason, d.finish_reason),
        stop_token_id=d.stop_token_id if has("stop_token_id") else None,
        new_logprobs=logprobs_table_from_proto(d.new_logprobs) if has("new_logprobs") else None,
        prompt_logprobs=(
            logprobs_table_from_proto(d.prompt_logprobs) if has("prompt_logprobs") else None
        ),
        events=[engine_core_event_from_proto(e) for e in d.events],
        num_cached_tokens=d.num_cached_tokens if has("num_cached_tokens") else None,
        error_message=d.error_message,
        error_kind=enum_member(ErrorKind, d.error_kind),
        pooling_output=d.pooling_output,
        kv_transfer_params_json=d.kv_transfer_params_json,
    )


HASH_BYTES = 32


def _external_hashes(data: bytes) -> list[int]:
    """32-byte prefix-cache hashes, concatenated -> vLLM's external block hashes (the low 64
    bits of each digest, unsigned)."""
    if len(data) % HASH_BYTES:
        raise ValueError(f"block_hashes of {len(data)} bytes is not a list of 32-byte hashes")
    return [int.from_bytes(data[i + 24 : i + 32], "big") for i in range(0, len(data), HASH_BYTES)]


def _stored_from_proto(msg: core_pb2.KvBlocksStored, block_size: int) -> BlocksStored:
    hashes = _external_hashes(msg.block_hashes)
    parent = msg.parent_block_hash
    if not hashes or len(parent) not in (0, HASH_BYTES):
        raise ValueError("a stored run needs blocks and a 32-byte parent hash (or none)")
    if len(msg.token_ids) != len(hashes) * block_size:
        raise ValueError(f"{len(msg.token_ids)} token ids for {len(hashes)} full blocks")
    if msg.extra_keys and len(msg.extra_keys) != len(hashes):
        raise ValueError("extra_keys must name every block of the run or none")
    extra = [
        BlockExtraKeys(
            k.cache_salt,
            tuple((m.identifier, m.offset) for m in k.multimodal),
            k.lora_name,
            msg.lora_id if k.lora_name else 0,
        )
        for k in msg.extra_keys
    ]
    return BlocksStored(
        hashes,
        int.from_bytes(parent[24:32], "big") if parent else None,
        list(msg.token_ids),
        extra or None,
    )


def kv_events_from_proto(msg: core_pb2.KvCacheEvents, block_size: int) -> KvEvents:
    """The core's events; ValueError when one is malformed (the batch cannot be trusted)."""
    events: list[KvEvent] = []
    for entry in msg.events:
        kind = entry.WhichOneof("event")
        if kind == "stored":
            events.append(_stored_from_proto(entry.stored, block_size))
        elif kind == "removed":
            events.append(BlocksRemoved(_external_hashes(entry.removed.block_hashes)))
        elif kind == "cleared":
            events.append(AllBlocksCleared())
        else:
            raise ValueError("a KV-cache event with no kind")
    return KvEvents(events)


def core_outputs_from_proto(msg: core_pb2.EngineCoreOutputs) -> CoreOutputs:
    return CoreOutputs(
        handles=list(msg.request_handles),
        num_new_tokens=list(msg.num_new_tokens),
        new_token_ids=list(msg.new_token_ids),
        details={d.request_handle: _detail_from_proto(d) for d in msg.details},
        timestamp=msg.timestamp,
        step_id=msg.step_id,
        scheduler_stats=(
            scheduler_stats_from_proto(msg.scheduler_stats)
            if msg.HasField("scheduler_stats")
            else None
        ),
    )


def engine_info_from_proto(msg: core_pb2.EngineInfo) -> EngineInfo:
    return EngineInfo(
        served_model_name=msg.served_model_name,
        max_model_len=msg.max_model_len,
        vocab_size=msg.vocab_size,
        num_kv_blocks=msg.num_kv_blocks,
        dtype=msg.dtype,
        enable_prefix_caching=msg.enable_prefix_caching,
        engine_id=msg.engine_id,
        max_concurrency=msg.max_concurrency,
        options=engine_info.options_of(msg),
        max_tokens_per_mm_item=msg.max_tokens_per_mm_item,
        pooler_config=pooler_config_from_proto(msg.pooler_config)
        if msg.HasField("pooler_config")
        else None,
    )


def lora_adapter_from_proto(msg: core_pb2.LoraAdapter) -> LoraAdapterInfo:
    return LoraAdapterInfo(msg.name, msg.path, msg.base_model_name, msg.max_rank)


def engine_snapshot_from_proto(msg: core_pb2.GetSchedulerStatsResponse) -> EngineSnapshot:
    """The core's stats and step histogram; a histogram whose counts do not match its bounds
    (one more than them, never decreasing) is dropped, not exported wrong."""
    stats = scheduler_stats_from_proto(msg.scheduler_stats)
    hist = msg.iteration_tokens
    bounds, counts = list(hist.upper_bounds), list(hist.cumulative_counts)
    is_valid = (
        len(counts) == len(bounds) + 1 and _ascending(counts) and _ascending(bounds, strictly=True)
    )
    state = HistogramState(bounds, counts, hist.sum) if is_valid and bounds else None
    return EngineSnapshot(stats, state)


def _ascending(values: list[float] | list[int], strictly: bool = False) -> bool:
    pairs = itertools.pairwise(values)
    return all(a < b for a, b in pairs) if strictly else all(a <= b for a, b in pairs)

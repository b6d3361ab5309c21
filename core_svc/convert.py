"""Protobuf <-> domain conversions of the engine core; the only core module using *_pb2.

Repeated scalar fields are filled with `.extend()` of whole lists (packed encoding, one C
call per column) so a step with a thousand requests costs a handful of calls.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import numpy as np

from core_svc.config import CoreConfig
from core_svc.kv_cache.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from core_svc.lora import LoraAdapter, LoraRegistry, LoraRequest
from core_svc.mm_inputs import MultiModalFeatureSpec
from core_svc.outputs import EngineCoreOutput, EngineCoreOutputs
from core_svc.request import Request
from core_svc.request_trace import request_trace
from core_svc.sched.scheduler_output import GrammarBitmask, SchedulerOutput
from core_svc.structured_output.grammar_state import StructuredOutputRequest
from core_svc.structured_output.structured_bitmask import sparse_bitmask
from core_svc.worker_pool import ModelFacts
from splitserve_contracts import engine_info, output_convert, structured_outputs
from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.core.v1 import core_service_pb2 as core_pb2
from splitserve_contracts.output_types import ModelRunnerOutput, StepStatus
from splitserve_contracts.worker.v1 import worker_service_pb2 as worker_pb2


def request_from_proto(
    msg: core_pb2.EngineCoreRequest,
    client_id: int,
    arrival_time: float | None = None,
    is_tracing: bool = False,
    loras: LoraRegistry | None = None,
) -> Request:
    """A new Request (no req_handle yet: EngineCore assigns it when the request is added). The
    sampler's settings stay serialized: the core only forwards them to the workers. A
    structured-outputs constraint is kept as given; the engine checks it when it adds the
    request (core_svc/engine/request_checks.py), and so is an adapter name `loras` does not know."""
    structured = None
    pooling_task = msg.pooling_params.task if msg.HasField("pooling_params") else ""
    if msg.HasField("structured_outputs"):
        params = structured_outputs.from_proto(msg.structured_outputs)
        if params is not None:
            end_id = msg.reasoning_end_token_id if msg.HasField("reasoning_end_token_id") else None
            structured = StructuredOutputRequest(params, end_id)
    kv_params, kv_problem = _kv_transfer_params(msg.kv_transfer_params_json)
    return Request(
        client_id=client_id,
        client_handle=msg.request_handle,
        request_id=msg.request_id,
        prompt_token_ids=list(msg.prompt_token_ids),
        output_token_ids=list(msg.output_token_ids),
        is_resumed=msg.resumed,
        max_tokens=1 if pooling_task else msg.max_tokens,  # one step, which samples nothing
        min_tokens=msg.min_tokens,
        stop_token_ids=tuple(msg.stop_token_ids),
        eos_token_id=msg.eos_token_id if msg.HasField("eos_token_id") else None,
        sampler_params=msg.sampler_params.SerializeToString(),
        skip_reading_prefix_cache=msg.sampler_params.HasField("prompt_logprobs"),
        pooling_task=pooling_task,
        cache_salt=msg.cache_salt,
        priority=msg.priority,
        arrival_time=arrival_time,
        mm_features=tuple(
            MultiModalFeatureSpec(
                f.identifier,
                f.offset,
                f.length,
                f.SerializeToString(),
                tuple(f.grid_thw),
                f.pixel_values.shape[0] if f.pixel_values.shape else 0,
            )
            for f in msg.mm_features
        ),
        structured_output=structured,
        lora=_lora_request(msg.lora_name, loras),
        trace=request_trace(msg.trace_context.traceparent, msg.trace_context.tracestate)
        if is_tracing
        else None,
        kv_transfer_params=kv_params,
        kv_transfer_params_problem=kv_problem,
    )


def _kv_transfer_params(text: str) -> tuple[dict[str, Any] | None, str]:
    """The request's kv_transfer_params ("", "{}" and "null": none) and why they are no JSON
    object ("" when they are; the engine refuses the request then)."""
    if not text:
        return None, ""
    try:
        value = json.loads(text)
    except ValueError as err:
        return None, f"kv_transfer_params: not JSON ({err})"
    if value is None or value == {}:
        return None, ""
    if not isinstance(value, dict):
        return None, "kv_transfer_params: expected a JSON object"
    return value, ""


def _lora_request(name: str, loras: LoraRegistry | None) -> LoraRequest | None:
    """The adapter a request names (lora_id 0: not loaded, refused when it is added)."""
    if loras is None:
        return LoraRequest(0, name, "") if name else None
    return loras.lookup(name)


def _detail_to_proto(detail: EngineCoreOutput, msg: core_pb2.EngineCoreOutput) -> None:
    msg.request_handle = detail.request_handle
    if detail.finish_reason is not None:
        msg.finish_reason = types_pb2.FinishReason.ValueType(detail.finish_reason)
    if detail.stop_token_id is not None:
        msg.stop_token_id = detail.stop_token_id
    if detail.new_logprobs is not None:
        output_convert.logprobs_table_to_proto(detail.new_logprobs, msg.new_logprobs)
    if detail.prompt_logprobs is not None:
        output_convert.logprobs_table_to_proto(detail.prompt_logprobs, msg.prompt_logprobs)
    for event in detail.events:
        output_convert.engine_core_event_to_proto(event, msg.events.add())
    if detail.num_cached_tokens is not None:
        msg.num_cached_tokens = detail.num_cached_tokens
    msg.error_message = detail.error_message
    msg.error_kind = core_pb2.ErrorKind.ValueType(detail.error_kind)
    if detail.pooling_output:
        msg.pooling_output = detail.pooling_output
    if detail.kv_transfer_params_json:
        msg.kv_transfer_params_json = detail.kv_transfer_params_json


def engine_core_outputs_to_proto(
    outputs: EngineCoreOutputs, msg: core_pb2.EngineCoreOutputs | None = None
) -> core_pb2.EngineCoreOutputs:
    """Fill `msg` (a new message when None: pass a response's field to build it in place)."""
    if msg is None:
        msg = core_pb2.EngineCoreOutputs()
    msg.request_handles.extend(outputs.request_handles)
    msg.num_new_tokens.extend(outputs.num_new_tokens)
    msg.new_token_ids.extend(outputs.new_token_ids)
    for detail in outputs.details:
        _detail_to_proto(detail, msg.details.add())
    msg.timestamp = outputs.timestamp
    msg.step_id = outputs.step_id
    if outputs.scheduler_stats is not None:
        output_convert.scheduler_stats_to_proto(outputs.scheduler_stats, msg.scheduler_stats)
    return msg


def kv_events_to_proto(events: Iterable[KVCacheEvent], msg: core_pb2.KvCacheEvents) -> None:
    """Each event once; a stored run's hashes as one bytes field, its tokens as one column."""
    for event in events:
        entry = msg.events.add()
        if isinstance(event, BlockStored):
            stored = entry.stored
            stored.block_hashes = b"".join(event.block_hashes)
            if event.parent_block_hash is not None:
                stored.parent_block_hash = event.parent_block_hash
            stored.token_ids.extend(event.token_ids)
            stored.lora_id = event.lora_id
            for keys in event.extra_keys or ():
                keys_msg = stored.extra_keys.add(
                    cache_salt=keys.cache_salt, lora_name=keys.lora_name
                )
                for identifier, offset in keys.multimodal:
                    keys_msg.multimodal.add(identifier=identifier, offset=offset)
        elif isinstance(event, BlockRemoved):
            entry.removed.block_hashes = b"".join(event.block_hashes)
        else:
            entry.cleared.SetInParent()


def stream_response_to_proto(outputs: EngineCoreOutputs) -> core_pb2.EngineStreamResponse:
    """One step's outputs for a client, with the KV-cache events it subscribed to; built in
    place (no copy of the outputs into the response)."""
    msg = core_pb2.EngineStreamResponse()
    msg.outputs.SetInParent()
    engine_core_outputs_to_proto(outputs, msg.outputs)
    if outputs.kv_events:
        kv_events_to_proto(outputs.kv_events, msg.kv_events)
    return msg


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
        if new_req.trace is not None:
            new_msg.trace_context.traceparent = new_req.trace.traceparent
            new_msg.trace_context.tracestate = new_req.trace.tracestate
        for feature in new_req.mm_features:
            new_msg.mm_features.add().MergeFromString(feature)
        if new_req.output_token_ids:
            new_msg.output_token_ids.extend(new_req.output_token_ids)
        if new_req.pooling_task:
            new_msg.pooling_params.task = new_req.pooling_task
        new_msg.lora_id = new_req.lora_id
        new_msg.state_slot = new_req.state_slot
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
    cached_msg.resumed_state_slots.extend(cached.resumed_state_slots)
    msg.num_scheduled_tokens.extend(output.num_scheduled_tokens)
    if output.num_spec_tokens:
        msg.num_spec_tokens.extend(output.num_spec_tokens)
    msg.finished_req_handles.extend(output.finished_req_handles)
    for handle, input_ids in output.scheduled_encoder_inputs.items():
        msg.scheduled_encoder_inputs.add(req_handle=handle, input_ids=input_ids)
    msg.free_encoder_mm_hashes.extend(output.free_encoder_mm_hashes)
    if output.grammar_bitmask is not None and not output.has_pending_grammar:
        _grammar_bitmask_to_proto(output.grammar_bitmask, msg.grammar_bitmask)
    msg.has_pending_grammar = output.has_pending_grammar
    if output.lora_slots is not None:
        slots = output.lora_slots
        msg.lora_slots.slots.extend(slots.slots)
        msg.lora_slots.lora_ids.extend(slots.lora_ids)
        msg.lora_slots.lora_paths.extend(slots.lora_paths)
    msg.free_lora_ids.extend(output.free_lora_ids)
    if output.kv_connector_metadata:
        msg.kv_connector_metadata = output.kv_connector_metadata
    return msg


def _grammar_bitmask_to_proto(bitmask: GrammarBitmask, msg: worker_pb2.GrammarBitmask) -> None:
    """The masks, in the sparse form when that is smaller (core_svc/structured_output/structured_bitmask.py)."""
    msg.req_handles.extend(bitmask.req_handles)
    num_rows = len(bitmask.req_handles)
    sparse = None
    if num_rows:
        words = np.frombuffer(bitmask.bitmask, "<i4").reshape(num_rows, -1)
        sparse = sparse_bitmask(words)
    if sparse is None:
        msg.bitmask = bitmask.bitmask
        return
    msg.sparse.num_words = sparse.num_words
    msg.sparse.row_defaults = sparse.row_defaults
    msg.sparse.num_listed_words.extend(sparse.num_listed_words)
    msg.sparse.word_indices = sparse.word_indices
    msg.sparse.words = sparse.words


def grammar_output_to_proto(output: SchedulerOutput) -> worker_pb2.ExecuteRequest:
    """The deferred grammar bitmask of a step sent with has_pending_grammar."""
    msg = worker_pb2.ExecuteRequest()
    msg.grammar_output.step_id = output.step_id
    if output.grammar_bitmask is not None:
        _grammar_bitmask_to_proto(output.grammar_bitmask, msg.grammar_output.grammar_bitmask)
    return msg


def model_runner_output_from_proto(msg: worker_pb2.ModelRunnerOutput) -> ModelRunnerOutput:
    """A STEP_STATUS_ERROR output comes back with an `error_message` (never empty), and the
    caller decides; its token columns are then meaningless. Columns that do not line up raise
    ValueError (a rank that answers that way cannot be trusted with the step)."""
    output = output_convert.model_runner_output_from_proto(msg)
    if output.status == StepStatus.ERROR:
        output.error_message = msg.error_message or f"rank {msg.rank} failed step {msg.step_id}"
    else:
        _check_sampled_columns(msg)
    if len(msg.failed_req_handles) != len(msg.failed_reasons):
        raise ValueError(f"rank {msg.rank}: failed requests and reasons do not line up")
    return output


def _check_sampled_columns(msg: worker_pb2.ModelRunnerOutput) -> None:
    """req_handles, the sampled tokens and their counts line up; ValueError otherwise."""
    num_reqs = len(msg.req_handles)
    counts, drafts = msg.num_sampled_token_ids, msg.num_draft_tokens
    num_tokens = sum(counts) if counts else num_reqs
    problem = None
    if (counts and len(counts) != num_reqs) or (drafts and len(drafts) != num_reqs):
        problem = "per-request token or draft counts that do not match its requests"
    elif num_tokens != len(msg.sampled_token_ids):
        counted = f"{num_tokens} tokens counted" if counts else f"{num_reqs} requests"
        problem = f"{counted} but {len(msg.sampled_token_ids)} sampled tokens"
    elif counts and (
        min(counts) < 1
        or any(n > d + 1 for n, d in zip(counts, drafts or [0] * num_reqs, strict=True))
    ):
        problem = "a request that sampled no token, or more than its drafts and one"
    if problem is not None:
        raise ValueError(f"rank {msg.rank} answered step {msg.step_id} with {problem}")


def engine_info_to_proto(
    config: CoreConfig, facts: ModelFacts, served_model_name: str
) -> core_pb2.EngineInfo:
    """The engine's options and facts for the frontends' Handshake (the options' deprecated
    copies filled too, for frontends older than EngineInfo.options)."""
    usable_tokens = (facts.num_kv_blocks - 1) * config.options.cache.block_size  # 0: null block
    info = core_pb2.EngineInfo(
        served_model_name=served_model_name,
        max_model_len=facts.max_model_len,
        vocab_size=facts.vocab_size,
        num_kv_blocks=facts.num_kv_blocks,
        dtype=facts.dtype,
        enable_prefix_caching=facts.serves_prefix_caching(
            config.options.cache.enable_prefix_caching
        ),
        engine_id=config.engine_id,
        max_concurrency=usable_tokens / facts.max_model_len,
        max_tokens_per_mm_item=facts.max_tokens_per_mm_item,
        pooler_config=output_convert.pooler_config_to_proto(facts.pooler_config)
        if facts.pooler_config is not None
        else None,
    )
    return engine_info.fill_options(info, config.options)


def lora_adapter_to_proto(adapter: LoraAdapter) -> core_pb2.LoraAdapter:
    return core_pb2.LoraAdapter(
        name=adapter.name,
        path=adapter.path,
        base_model_name=adapter.base_model_name,
        lora_id=adapter.lora_id,
        max_rank=adapter.max_rank,
    )

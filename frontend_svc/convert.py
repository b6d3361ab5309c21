"""Where protobuf stops: public and core contracts <-> the frontend's own types."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

from frontend_svc.engine_types import (
    CoreOutputDetail,
    CoreOutputs,
    EngineInfo,
    LogprobsTable,
)
from frontend_svc.requests import (
    ChatTurn,
    CompletionDelta,
    EngineRequest,
    GenerateInput,
    Logprob,
    PromptInput,
    TokenLogprobs,
)
from frontend_svc.sampling_params import SamplingParams
from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.core.v1 import core_service_pb2 as core_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2

_OPTIONAL_DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "repetition_penalty": 1.0,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
}
_OPTIONAL_NONE = ("seed", "max_tokens", "logprobs", "prompt_logprobs")


def sampling_params_from_proto(msg: types_pb2.SamplingParams) -> SamplingParams:
    """Proto -> domain, honouring `optional` presence (unset takes vLLM's default)."""
    has_field = cast(Callable[[str], bool], msg.HasField)  # field names come from this module
    values: dict[str, object] = {
        name: getattr(msg, name) if has_field(name) else default
        for name, default in _OPTIONAL_DEFAULTS.items()
    }
    for name in _OPTIONAL_NONE:
        values[name] = getattr(msg, name) if has_field(name) else None
    return SamplingParams(
        n=msg.n or 1,
        top_k=msg.top_k,
        min_p=msg.min_p,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        min_tokens=msg.min_tokens,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        logit_bias=dict(msg.logit_bias),
        allowed_token_ids=tuple(msg.allowed_token_ids),
        **values,  # type: ignore[arg-type]
    )


def sampling_params_to_proto(p: SamplingParams, out: types_pb2.SamplingParams) -> None:
    """Domain -> proto with every field explicit (the core needs no defaults of its own)."""
    out.n = p.n
    out.temperature = p.temperature
    out.top_p = p.top_p
    out.top_k = p.top_k
    out.min_p = p.min_p
    out.presence_penalty = p.presence_penalty
    out.frequency_penalty = p.frequency_penalty
    out.repetition_penalty = p.repetition_penalty
    out.stop.extend(p.stop)
    out.stop_token_ids.extend(p.stop_token_ids)
    out.ignore_eos = p.ignore_eos
    out.min_tokens = p.min_tokens
    out.skip_special_tokens = p.skip_special_tokens
    out.include_stop_str_in_output = p.include_stop_str_in_output
    out.spaces_between_special_tokens = p.spaces_between_special_tokens
    out.allowed_token_ids.extend(p.allowed_token_ids)
    out.logit_bias.update(p.logit_bias)
    for name in _OPTIONAL_NONE:
        value = getattr(p, name)
        if value is not None:
            setattr(out, name, value)


def _chat_from_proto(chat: gen_pb2.Chat) -> tuple[tuple[ChatTurn, ...], bool]:
    turns = tuple(ChatTurn(m.role, m.content) for m in chat.messages)
    add_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    return turns, add_prompt


def prompt_from_proto(msg: gen_pb2.GenerateRequest | gen_pb2.TokenizeRequest) -> PromptInput:
    """The `input` oneof of a Generate or Tokenize request."""
    add_special = msg.add_special_tokens if msg.HasField("add_special_tokens") else True
    kind = msg.WhichOneof("input")
    if kind == "chat":
        turns, add_prompt = _chat_from_proto(msg.chat)
        return PromptInput(chat=turns, add_generation_prompt=add_prompt)
    if kind == "prompt_token_ids":
        assert isinstance(msg, gen_pb2.GenerateRequest)
        return PromptInput(token_ids=tuple(msg.prompt_token_ids.ids))
    if kind == "prompt":
        return PromptInput(text=msg.prompt, add_special_tokens=add_special)
    return PromptInput()


def generate_input_from_proto(msg: gen_pb2.GenerateRequest, request_id: str) -> GenerateInput:
    return GenerateInput(
        request_id=request_id,
        prompt=prompt_from_proto(msg),
        params=sampling_params_from_proto(msg.sampling_params),
        priority=msg.priority,
        cache_salt=msg.cache_salt,
    )


def _logprob_to_proto(src: Logprob, dst: types_pb2.Logprob) -> None:
    dst.token_id, dst.logprob, dst.rank = src.token_id, src.logprob, src.rank
    dst.decoded_token = src.decoded_token


def _token_logprobs_to_proto(
    rows: list[TokenLogprobs], out: RepeatedCompositeFieldContainer[types_pb2.TokenLogprobs]
) -> None:
    for row in rows:
        entry = out.add()
        _logprob_to_proto(row.chosen, entry.chosen)
        for top in row.top:
            _logprob_to_proto(top, entry.top.add())


def delta_to_proto(request_id: str, delta: CompletionDelta) -> gen_pb2.GenerateResponse:
    msg = gen_pb2.GenerateResponse(
        request_id=request_id,
        index=delta.index,
        token_ids=delta.token_ids,
        text=delta.text,
        finish_reason=int(delta.finish_reason),  # type: ignore[arg-type]
        usage=gen_pb2.Usage(
            prompt_tokens=delta.prompt_tokens,
            completion_tokens=delta.completion_tokens,
            cached_tokens=delta.cached_tokens,
        ),
    )
    if delta.stop_str is not None:
        msg.stop_str = delta.stop_str
    elif delta.stop_token_id is not None:
        msg.stop_token_id = delta.stop_token_id
    if delta.logprobs:
        _token_logprobs_to_proto(delta.logprobs, msg.logprobs)
    if delta.prompt_logprobs:
        _token_logprobs_to_proto(delta.prompt_logprobs, msg.prompt_logprobs)
    return msg


def engine_request_to_proto(handle: int, req: EngineRequest) -> core_pb2.EngineCoreRequest:
    msg = core_pb2.EngineCoreRequest(
        request_id=req.request_id,
        request_handle=handle,
        prompt_token_ids=req.prompt_token_ids,
        cache_salt=req.cache_salt,
        priority=req.priority,
    )
    if req.eos_token_id is not None:
        msg.eos_token_id = req.eos_token_id
    sampling_params_to_proto(req.params, msg.sampling_params)
    return msg


def _table_from_proto(msg: types_pb2.LogprobsTable) -> LogprobsTable:
    return LogprobsTable(
        msg.num_top_logprobs, list(msg.token_ids), list(msg.logprobs), list(msg.ranks)
    )


def _detail_from_proto(d: core_pb2.EngineCoreOutput) -> CoreOutputDetail:
    return CoreOutputDetail(
        handle=d.request_handle,
        finish_reason=d.finish_reason,
        stop_token_id=d.stop_token_id if d.HasField("stop_token_id") else None,
        new_logprobs=_table_from_proto(d.new_logprobs) if d.HasField("new_logprobs") else None,
        prompt_logprobs=(
            _table_from_proto(d.prompt_logprobs) if d.HasField("prompt_logprobs") else None
        ),
        events=[(e.type, e.timestamp) for e in d.events],
        num_cached_tokens=d.num_cached_tokens if d.HasField("num_cached_tokens") else None,
        error_message=d.error_message,
    )


def core_outputs_from_proto(msg: core_pb2.EngineCoreOutputs) -> CoreOutputs:
    return CoreOutputs(
        handles=list(msg.request_handles),
        num_new_tokens=list(msg.num_new_tokens),
        new_token_ids=list(msg.new_token_ids),
        details={d.request_handle: _detail_from_proto(d) for d in msg.details},
        timestamp=msg.timestamp,
        step_index=msg.step_index,
    )


def engine_info_from_proto(msg: core_pb2.EngineInfo) -> EngineInfo:
    return EngineInfo(
        served_model_name=msg.served_model_name,
        model_path=msg.model_path,
        max_model_len=msg.max_model_len,
        vocab_size=msg.vocab_size,
        block_size=msg.block_size,
        num_kv_blocks=msg.num_kv_blocks,
        tensor_parallel_size=msg.tensor_parallel_size,
        pipeline_parallel_size=msg.pipeline_parallel_size,
        dtype=msg.dtype,
        max_num_seqs=msg.max_num_seqs,
        max_num_batched_tokens=msg.max_num_batched_tokens,
        enable_prefix_caching=msg.enable_prefix_caching,
        engine_id=msg.engine_id,
        max_concurrency=msg.max_concurrency,
    )

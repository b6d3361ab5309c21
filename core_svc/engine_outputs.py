"""Build the per-client EngineCoreOutputs of a step from the requests that produced something."""

from __future__ import annotations

from collections.abc import Iterable

from core_svc.outputs import EngineCoreOutput, EngineCoreOutputs, ModelRunnerOutput
from core_svc.request import Request


def make_detail(
    request: Request, model_runner_output: ModelRunnerOutput | None = None
) -> EngineCoreOutput:
    """A request's details beyond its new tokens: finish, logprobs, pending events, and
    the prefix-cache hit with its first token."""
    new_logprobs = prompt_logprobs = None
    if model_runner_output is not None:
        new_logprobs = model_runner_output.logprobs.get(request.req_handle)
        prompt_logprobs = model_runner_output.prompt_logprobs.get(request.req_handle)
    is_first_token = len(request.output_token_ids) == 1
    return EngineCoreOutput(
        request_handle=request.client_handle,
        finish_reason=request.status.finish_reason,
        stop_token_id=request.stop_reason,
        new_logprobs=new_logprobs,
        prompt_logprobs=prompt_logprobs,
        events=request.take_events(),
        num_cached_tokens=max(request.num_cached_tokens, 0) if is_first_token else None,
        error_message=request.error_message,
        error_kind=request.error_kind,
    )


def make_step_outputs(
    requests: list[Request], token_ids: list[int], model_runner_output: ModelRunnerOutput
) -> dict[int, EngineCoreOutputs]:
    """Columnar outputs per client_id: requests[i] gained token_ids[i]. A detail is added
    only when the request finished, has logprobs or has events pending (which includes
    its first token: QUEUED and SCHEDULED are always pending then)."""
    has_logprobs = bool(model_runner_output.logprobs or model_runner_output.prompt_logprobs)
    outputs: dict[int, EngineCoreOutputs] = {}
    last_client_id = -1
    handles: list[int] = []
    counts: list[int] = []
    tokens: list[int] = []
    details: list[EngineCoreOutput] = []
    for request, token in zip(requests, token_ids, strict=True):
        if request.client_id != last_client_id:
            last_client_id = request.client_id
            engine_outputs = outputs.get(last_client_id)
            if engine_outputs is None:
                engine_outputs = outputs[last_client_id] = EngineCoreOutputs()
            handles = engine_outputs.request_handles
            counts = engine_outputs.num_new_tokens
            tokens = engine_outputs.new_token_ids
            details = engine_outputs.details
        handles.append(request.client_handle)
        counts.append(1)
        tokens.append(token)
        if request.events or has_logprobs or request.is_finished:
            details.append(make_detail(request, model_runner_output))
    return outputs


def make_final_outputs(requests: Iterable[Request]) -> dict[int, EngineCoreOutputs]:
    """One detail (finish reason, error message) per finished request, per client_id."""
    outputs: dict[int, EngineCoreOutputs] = {}
    for request in requests:
        outputs.setdefault(request.client_id, EngineCoreOutputs()).details.append(
            make_detail(request)
        )
    return outputs


def merge_outputs(
    outputs: dict[int, EngineCoreOutputs], more: dict[int, EngineCoreOutputs]
) -> dict[int, EngineCoreOutputs]:
    """Fold `more` into `outputs` (client by client) and return it."""
    for client_id, engine_outputs in more.items():
        if client_id in outputs:
            outputs[client_id].merge(engine_outputs)
        else:
            outputs[client_id] = engine_outputs
    return outputs

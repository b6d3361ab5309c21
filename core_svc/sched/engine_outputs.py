"""Build the per-client EngineCoreOutputs of a step from the requests that produced something."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable

from core_svc.outputs import EngineCoreOutput, EngineCoreOutputs
from core_svc.request import Request
from core_svc.sched.step_update import StepUpdate
from splitserve_contracts.output_types import LogprobsTable, ModelRunnerOutput

logger = logging.getLogger(__name__)


def make_detail(
    request: Request,
    new_logprobs: LogprobsTable | None = None,
    prompt_logprobs: LogprobsTable | None = None,
) -> EngineCoreOutput:
    """A request's details beyond its new tokens: finish, logprobs, pending events, and
    the prefix-cache hit with its first token."""
    is_first_token = len(request.output_token_ids) == 1
    kv_params = request.kv_transfer_params
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
        pooling_output=request.pooling_output,
        kv_transfer_params_json=json.dumps(kv_params)
        if kv_params is not None and request.is_finished
        else "",
    )


def make_step_outputs(
    requests: list[Request],
    token_ids: list[int],
    model_runner_output: ModelRunnerOutput,
    num_tokens: list[int] | None = None,
) -> dict[int, EngineCoreOutputs]:
    """Columnar outputs per client_id: requests[i] gained token_ids[i], or the next
    num_tokens[i] of token_ids when given (speculative decoding). A detail is added
    only when the request finished, has logprobs or has events pending (which includes
    its first token: QUEUED and SCHEDULED are always pending then)."""
    logprobs = {e.req_handle: e.table for e in model_runner_output.logprobs}
    prompt_logprobs = {e.req_handle: e.table for e in model_runner_output.prompt_logprobs}
    has_logprobs = bool(logprobs or prompt_logprobs)
    outputs: dict[int, EngineCoreOutputs] = {}
    last_client_id = -1
    handles: list[int] = []
    counts: list[int] = []
    tokens: list[int] = []
    details: list[EngineCoreOutput] = []
    if num_tokens:
        runs = _runs(token_ids, num_tokens)
    for i, request in enumerate(requests):
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
        if num_tokens:
            counts.append(num_tokens[i])
            tokens.extend(runs[i])
        else:
            counts.append(1)
            tokens.append(token_ids[i])
        if request.events or has_logprobs or request.is_finished:
            handle = request.req_handle
            table = logprobs.get(handle)
            if table is not None and num_tokens and len(table.ranks) > num_tokens[i]:
                table = _first_rows(table, num_tokens[i])  # a stop ended its run early
            details.append(make_detail(request, table, prompt_logprobs.get(handle)))
    return outputs


def _first_rows(table: LogprobsTable, num_rows: int) -> LogprobsTable:
    width = (table.num_top_logprobs + 1) * num_rows
    return LogprobsTable(
        table.num_top_logprobs,
        table.token_ids[:width],
        table.logprobs[:width],
        table.ranks[:num_rows],
    )


def _runs(token_ids: list[int], counts: list[int]) -> list[list[int]]:
    runs, start = [], 0
    for count in counts:
        runs.append(token_ids[start : start + count])
        start += count
    return runs


def make_update_outputs(
    update: StepUpdate, model_runner_output: ModelRunnerOutput, step_id: int
) -> dict[int, EngineCoreOutputs]:
    """The outputs of an applied step: the sampled tokens, and a final detail for each request
    that failed."""
    outputs = make_step_outputs(
        update.sampled_reqs,
        update.sampled_token_ids,
        model_runner_output,
        update.num_sampled_tokens,
    )
    if update.pooled:
        merge_outputs(outputs, make_final_outputs(update.pooled))
    if update.failed:
        logger.error("step %d: %d requests failed", step_id, len(update.failed))
        merge_outputs(outputs, make_final_outputs(update.failed))
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

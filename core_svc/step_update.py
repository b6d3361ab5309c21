"""Applying a step's output to the scheduler's requests: what each sampled, who finished, who
failed (the half of the scheduler that runs when a step's output comes back)."""

from __future__ import annotations

from dataclasses import dataclass, field

from core_svc.block_hash import BlockHasher
from core_svc.encoder_scheduler import EncoderScheduler
from core_svc.kv_cache_manager import KVCacheManager
from core_svc.request import Request, RequestStatus
from core_svc.scheduler_output import SchedulerOutput
from core_svc.stop_check import check_stop
from core_svc.structured_output import StructuredOutputRequest
from splitserve_contracts.output_types import ErrorKind, ModelRunnerOutput

_RUNNING = RequestStatus.RUNNING


@dataclass(slots=True)
class StepUpdate:
    """What applying one step's output did: who sampled what, who finished, who failed."""

    sampled_reqs: list[Request] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)
    pooled: list[Request] = field(default_factory=list)
    """Pooling requests whose prompt ran this step: finished with their pooled vector (also
    in `finished`)."""
    num_prompt_tokens: int = 0
    """Prompt tokens of the requests that sampled their first token (or pooled) this step."""


@dataclass(slots=True)
class ScheduledStep:
    """A step sent to the workers whose output is not applied yet: its requests in the
    contract's order and the num_computed_tokens each one has once the step has run."""

    step_id: int
    requests: list[Request]
    num_computed_tokens: list[int]
    structured: list[tuple[Request, int]] = field(default_factory=list)
    """The constrained requests that sample in the step, each with the position of the token
    it samples (its num_computed_tokens once the step has run)."""


class StepUpdater:
    """Applies steps' outputs to their requests, with the scheduler's KV cache, block hasher
    and encoder scheduler."""

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        block_hasher: BlockHasher,
        encoder: EncoderScheduler,
        *,
        max_model_len: int,
        vocab_size: int,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.block_hasher = block_hasher
        self.encoder = encoder
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def apply(
        self,
        scheduled: ScheduledStep,
        scheduler_output: SchedulerOutput,
        model_runner_output: ModelRunnerOutput,
        requests: dict[int, Request],
    ) -> StepUpdate:
        """Fail the requests the ranks refused for their own invalid data (INVALID_REQUEST);
        then per scheduled request: cache blocks that became full, append its sampled token,
        extend its block hashes and check stops. `requests`: the live ones by req_handle."""
        _check_order(scheduled, scheduler_output)
        update = StepUpdate(failed=_fail_refused(model_runner_output, requests))
        sampled = dict(
            zip(model_runner_output.req_handles, model_runner_output.sampled_token_ids, strict=True)
        )
        pooled = {p.req_handle: p.data for p in model_runner_output.pooler_outputs}
        kv = self.kv_cache_manager
        block_size, max_model_len, vocab_size = kv.block_size, self.max_model_len, self.vocab_size
        cache_blocks = kv.cache_blocks if kv.enable_caching else None
        extend_hashes = self.block_hasher.extend
        for request, num_new_tokens, num_computed in zip(
            scheduled.requests,
            scheduler_output.num_scheduled_tokens,
            scheduled.num_computed_tokens,
            strict=True,
        ):
            if request.status is not _RUNNING:
                continue
            all_token_ids = request.all_token_ids
            if cache_blocks and num_computed % block_size < num_new_tokens:
                cache_blocks(request, num_computed)  # a block became full this step
            if request.mm_features:
                self.encoder.release_computed(request)
            if num_computed < len(all_token_ids):
                continue  # a prefill chunk: nothing sampled
            if request.pooling_task:
                _finish_pooled(request, pooled.get(request.req_handle), scheduled.step_id, update)
                continue
            token = sampled.get(request.req_handle)
            if token is None or token >= vocab_size:
                update.failed.append(_fail_unsampled(request, token, scheduled.step_id))
                continue
            if not request.output_token_ids:
                update.num_prompt_tokens += request.num_prompt_tokens
            request.output_token_ids.append(token)
            all_token_ids.append(token)
            if cache_blocks and len(all_token_ids) % block_size == 0:
                extend_hashes(
                    request.block_hashes,
                    all_token_ids,
                    request.cache_salt,
                    request.mm_features,
                    request.lora_hash_key,
                )
            grammar = request.structured_output
            if grammar is not None and _grammar_stops(request, grammar, token, update):
                pass
            elif (
                token in request.all_stop_token_ids
                or len(request.output_token_ids) >= request.max_tokens
            ) and check_stop(request, max_model_len):
                update.finished.append(request)
            update.sampled_reqs.append(request)
            update.sampled_token_ids.append(token)
        return update


def _grammar_stops(
    request: Request, grammar: StructuredOutputRequest, token: int, update: StepUpdate
) -> bool:
    """Advance the request's matcher by its new token: a complete grammar finishes it (STOP), a
    token the grammar refuses (its mask did not hold) fails it; True when it ended."""
    if not grammar.accept(token):
        request.fail(
            ErrorKind.ENGINE_FAILURE,
            f"the output rank sampled token {token}, which the request's grammar does not allow",
        )
        update.failed.append(request)
        return True
    if grammar.is_terminated:
        request.finish(RequestStatus.FINISHED_STOPPED)
        update.finished.append(request)
        return True
    return False


def _finish_pooled(request: Request, data: bytes | None, step_id: int, update: StepUpdate) -> None:
    """A pooling request whose prompt ran: it finishes (STOP) with its pooled vector, or with
    ENGINE_FAILURE when the output rank sent none."""
    if not data:
        request.fail(ErrorKind.ENGINE_FAILURE, f"step {step_id}: the output rank pooled nothing")
        update.failed.append(request)
        return
    request.pooling_output = data
    request.finish(RequestStatus.FINISHED_STOPPED)
    update.num_prompt_tokens += request.num_prompt_tokens
    update.finished.append(request)
    update.pooled.append(request)


def _check_order(scheduled: ScheduledStep, scheduler_output: SchedulerOutput) -> None:
    if scheduled.step_id != scheduler_output.step_id:
        raise AssertionError(
            f"the output of step {scheduler_output.step_id} came before step {scheduled.step_id}'s"
        )


def _fail_refused(output: ModelRunnerOutput, requests: dict[int, Request]) -> list[Request]:
    refused = []
    for handle, reason in zip(output.failed_req_handles, output.failed_reasons, strict=True):
        request = requests.get(handle)
        if request is not None and not request.is_finished:
            request.fail(ErrorKind.INVALID_REQUEST, reason)
            refused.append(request)
    return refused


def _fail_unsampled(request: Request, token: int | None, step_id: int) -> Request:
    """A request whose scheduled tokens reached its end but that sampled nothing, or an id
    outside the vocabulary: the output rank is broken, the request ends with ENGINE_FAILURE."""
    what = "no token" if token is None else "a token outside the vocabulary"
    request.fail(ErrorKind.ENGINE_FAILURE, f"step {step_id}: the output rank sampled {what}")
    return request

"""Applying a step's output to the scheduler's requests: what each sampled, who finished, who
failed (the half of the scheduler that runs when a step's output comes back)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from core_svc.kv_cache.block_hash import BlockHasher
from core_svc.kv_cache.kv_cache_manager import KVCacheManager
from core_svc.request import Request, RequestStatus
from core_svc.sched.encoder_scheduler import EncoderScheduler
from core_svc.sched.scheduler_output import GrammarBitmask, SchedulerOutput
from core_svc.sched.stop_check import check_stop
from core_svc.structured_output.grammar_state import StructuredOutputRequest
from splitserve_contracts.output_types import ErrorKind, ModelRunnerOutput

logger = logging.getLogger(__name__)
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
    num_sampled_tokens: list[int] = field(default_factory=list)
    """Tokens each of sampled_reqs gained, in order in sampled_token_ids (empty: one each)."""
    spec_reqs: list[tuple[Request, int, int]] = field(default_factory=list)
    """Requests that had draft slots: (request, its slots, tokens the ranks sampled for it)."""


@dataclass(slots=True)
class SpecDecodingStats:
    """Speculative decoding since the engine started (vLLM's SpecDecodingStats, cumulative)."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        for i in range(num_accepted_tokens):
            per_pos[i] += 1


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
        self.block_size = kv_cache_manager.block_size
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
        spec_stats: SpecDecodingStats,
    ) -> StepUpdate:
        """Fail the requests the ranks refused for their own invalid data (INVALID_REQUEST);
        then per scheduled request: cache blocks that became full, append its sampled tokens
        (several when it verified drafts), extend its block hashes and check stops.
        `requests`: the live ones by req_handle."""
        _check_order(scheduled, scheduler_output)
        update = StepUpdate(failed=_fail_refused(model_runner_output, requests))
        output = model_runner_output
        if output.num_sampled_token_ids:
            return self._apply_runs(scheduled, scheduler_output, output, update, spec_stats)
        sampled = dict(zip(output.req_handles, output.sampled_token_ids, strict=True))
        pooled = {p.req_handle: p.data for p in output.pooler_outputs}
        kv = self.kv_cache_manager
        block_size, vocab_size = kv.block_size, self.vocab_size
        cache_blocks = kv.cache_blocks if kv.enable_caching else None
        for request, num_new_tokens, num_computed in zip(
            scheduled.requests,
            scheduler_output.num_scheduled_tokens,
            scheduled.num_computed_tokens,
            strict=True,
        ):
            if request.status is not _RUNNING:
                continue
            if cache_blocks and num_computed % block_size < num_new_tokens:
                cache_blocks(request, num_computed)  # a block became full this step
            if request.mm_features:
                self.encoder.release_computed(request)
            if num_computed < len(request.all_token_ids):
                continue  # a prefill chunk: nothing sampled
            if request.pooling_task:
                _finish_pooled(request, pooled.get(request.req_handle), scheduled.step_id, update)
                continue
            token = sampled.get(request.req_handle)
            if token is None or token >= vocab_size:
                update.failed.append(_fail_unsampled(request, token, scheduled.step_id))
                continue
            grammar = request.structured_output
            if grammar is not None and grammar.failure is not None:
                update.failed.append(_fail_dead_end(request, grammar.failure))
                continue
            self._append(request, token, update, scheduler_output.grammar_bitmask)
            update.sampled_reqs.append(request)
        return update

    def _apply_runs(
        self,
        scheduled: ScheduledStep,
        scheduler_output: SchedulerOutput,
        output: ModelRunnerOutput,
        update: StepUpdate,
        spec_stats: SpecDecodingStats,
    ) -> StepUpdate:
        """`apply` for a step whose requests sampled several tokens each (speculative
        decoding): each run of accepted drafts and the token after them is appended token by
        token (a stop ends the run there), then the blocks its verified tokens filled are
        cached (the last sampled token has no KV yet)."""
        runs = _sampled_runs(output)
        num_spec = scheduler_output.num_spec_tokens or [0] * len(scheduled.requests)
        kv = self.kv_cache_manager
        cache_blocks = kv.cache_blocks if kv.enable_caching else None
        for request, num_computed, num_slots in zip(
            scheduled.requests, scheduled.num_computed_tokens, num_spec, strict=True
        ):
            if request.status is not _RUNNING:
                continue
            if request.mm_features:
                self.encoder.release_computed(request)
            if num_computed < len(request.all_token_ids):
                if cache_blocks:
                    cache_blocks(request, num_computed)
                continue  # a prefill chunk: nothing sampled
            run = runs.get(request.req_handle)
            if run is None or max(run[0]) >= self.vocab_size or len(run[0]) > num_slots + 1:
                token = None if run is None else max(run[0])
                update.failed.append(_fail_unsampled(request, token, scheduled.step_id))
                continue
            grammar = request.structured_output
            if grammar is not None and grammar.failure is not None:
                update.failed.append(_fail_dead_end(request, grammar.failure))
                continue
            tokens, num_drafts = run
            num_appended = 0
            mask = scheduler_output.grammar_bitmask
            for position, token in enumerate(tokens):
                num_appended += 1
                if self._append(request, token, update, mask, position):
                    break
            if cache_blocks:
                cache_blocks(request, len(request.all_token_ids) - 1)
            update.sampled_reqs.append(request)
            update.num_sampled_tokens.append(num_appended)
            if num_slots:
                update.spec_reqs.append((request, num_slots, len(tokens)))
            if num_drafts:
                spec_stats.observe_draft(num_drafts, len(tokens) - 1)
        return update

    def _append(
        self,
        request: Request,
        token: int,
        update: StepUpdate,
        mask: GrammarBitmask | None,
        position: int = 0,
    ) -> bool:
        """Append one sampled token (sampled under the request's `position`-th row of the step's
        `mask`): block hashes, grammar, stops; True when it ended the request (finished or
        failed)."""
        all_token_ids = request.all_token_ids
        if not request.output_token_ids:
            update.num_prompt_tokens += request.num_prompt_tokens
        request.output_token_ids.append(token)
        all_token_ids.append(token)
        if self.kv_cache_manager.enable_caching and len(all_token_ids) % self.block_size == 0:
            self.block_hasher.extend(
                request.block_hashes,
                all_token_ids,
                request.cache_salt,
                request.mm_features,
                request.lora_hash_key,
            )
        update.sampled_token_ids.append(token)
        grammar = request.structured_output
        if grammar is not None and _grammar_stops(request, grammar, token, update, mask, position):
            return True
        if (
            token in request.all_stop_token_ids
            or len(request.output_token_ids) >= request.max_tokens
        ) and check_stop(request, self.max_model_len):
            update.finished.append(request)
            return True
        return False


def _sampled_runs(output: ModelRunnerOutput) -> dict[int, tuple[list[int], int]]:
    """req_handle -> (its sampled tokens, the drafts it verified)."""
    runs = {}
    tokens, start = output.sampled_token_ids, 0
    drafts = output.num_draft_tokens or [0] * len(output.req_handles)
    for handle, count, num_drafts in zip(
        output.req_handles, output.num_sampled_token_ids, drafts, strict=True
    ):
        runs[handle] = (tokens[start : start + count], num_drafts)
        start += count
    return runs


def _fail_dead_end(request: Request, failure: str) -> Request:
    """A request whose grammar the step's fill found unable to go on with a token the model can
    emit (StructuredOutputRequest.failure): it fails, and what it sampled is dropped."""
    logger.warning("request %s: %s", request.request_id[:64], failure)
    request.fail(ErrorKind.INVALID_REQUEST, failure)
    return request


def _grammar_stops(
    request: Request,
    grammar: StructuredOutputRequest,
    token: int,
    update: StepUpdate,
    mask: GrammarBitmask | None,
    position: int,
) -> bool:
    """Advance the request's matcher by its new token: a complete grammar finishes it (STOP); a
    token the matcher refuses fails it, ENGINE_FAILURE when the step's mask did not allow it
    (the rank broke it), INVALID_REQUEST when it did (the matcher failed: one of llguidance's
    limits); True when it ended."""
    if not grammar.accept(token):
        was_allowed = _mask_allows(mask, request.req_handle, position, token)
        kind, message = grammar.refusal(token, was_allowed)
        logger.warning("request %s: %s", request.request_id[:64], message)
        request.fail(kind, message)
        update.failed.append(request)
        return True
    if grammar.is_terminated:
        request.finish(RequestStatus.FINISHED_STOPPED)
        update.finished.append(request)
        return True
    return False


def _mask_allows(mask: GrammarBitmask | None, req_handle: int, position: int, token: int) -> bool:
    """Whether the request's `position`-th row of a step's mask (its next token's, then one per
    draft) allows `token`; False where it has no such row."""
    if mask is None:
        return False
    rows = [i for i, handle in enumerate(mask.req_handles) if handle == req_handle]
    if position >= len(rows):
        return False
    row_bytes = len(mask.bitmask) // len(mask.req_handles)
    byte = mask.bitmask[rows[position] * row_bytes + token // 8]
    return bool(byte >> (token % 8) & 1)  # little-endian words: bit t is in byte t // 8


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

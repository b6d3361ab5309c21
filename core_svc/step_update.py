"""Applying a step's output to the scheduler's requests: what each sampled, who finished, who
failed (the half of the scheduler that runs when a step's output comes back)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from core_svc.outputs import ErrorKind, ModelRunnerOutput
from core_svc.request import Request, RequestStatus
from core_svc.scheduler_output import SchedulerOutput
from core_svc.stop_check import check_stop

if TYPE_CHECKING:
    from core_svc.scheduler import Scheduler

_RUNNING = RequestStatus.RUNNING


@dataclass(slots=True)
class StepUpdate:
    """What applying one step's output did: who sampled what, who finished, who failed."""

    sampled_reqs: list[Request] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)
    num_prompt_tokens: int = 0
    """Prompt tokens of the requests that sampled their first token in this step."""


@dataclass(slots=True)
class ScheduledStep:
    """A step sent to the workers whose output is not applied yet: its requests in the
    contract's order and the num_computed_tokens each one has once the step has run."""

    step_id: int
    requests: list[Request]
    num_computed_tokens: list[int]

    def add_output_placeholders(self) -> None:
        """Async scheduling: a request whose scheduled tokens reach its end samples in this
        step; its token is a placeholder until the step's output comes back (the next step may
        be scheduled before that, with the placeholder as its input). Applying the output
        takes the placeholder back."""
        for request, num_computed in zip(self.requests, self.num_computed_tokens, strict=True):
            if num_computed == len(request.all_token_ids) + request.num_output_placeholders:
                request.num_output_placeholders += 1


def append_sampled_tokens(
    scheduler: Scheduler,
    scheduled: ScheduledStep,
    scheduler_output: SchedulerOutput,
    model_runner_output: ModelRunnerOutput,
) -> StepUpdate:
    """Per scheduled request: cache blocks that became full, then append its sampled
    token, extend its block hashes and check stops."""
    if scheduled.step_id != scheduler_output.step_id:
        raise AssertionError(
            f"the output of step {scheduler_output.step_id} came before step {scheduled.step_id}'s"
        )
    is_async = scheduler.async_scheduling
    sampled = dict(
        zip(model_runner_output.req_handles, model_runner_output.sampled_token_ids, strict=True)
    )
    update = StepUpdate()
    block_size = scheduler.block_size
    max_model_len = scheduler.max_model_len
    vocab_size = scheduler.vocab_size
    cache_blocks = scheduler.kv_cache_manager.cache_blocks if scheduler.enable_caching else None
    extend_hashes = scheduler.block_hasher.extend
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
            scheduler.encoder.release_computed(request)
        if num_computed < len(all_token_ids):
            continue  # a prefill chunk: nothing sampled
        token = sampled.get(request.req_handle)
        if token is None or token >= vocab_size:
            request.fail(
                ErrorKind.ENGINE_FAILURE,
                f"step {scheduler.step_id}: the output rank sampled "
                f"{'no token' if token is None else 'a token outside the vocabulary'}",
            )
            update.failed.append(request)
            continue
        if is_async:  # the ranks appended it themselves
            request.num_output_placeholders -= 1
            request.num_sent_token_ids += 1
        if not request.output_token_ids:
            update.num_prompt_tokens += request.num_prompt_tokens
        request.output_token_ids.append(token)
        all_token_ids.append(token)
        if cache_blocks and len(all_token_ids) % block_size == 0:
            extend_hashes(
                request.block_hashes, all_token_ids, request.cache_salt, request.mm_features
            )
        if (
            token in request.all_stop_token_ids
            or len(request.output_token_ids) >= request.max_tokens
        ) and check_stop(request, max_model_len):
            update.finished.append(request)
        update.sampled_reqs.append(request)
        update.sampled_token_ids.append(token)
    return update

"""A step's ModelRunnerOutput on the output rank: its status, timings and refused requests, and
what its sampling requests sampled (tokens, the drafts they kept, logprobs).

Only the output rank builds one (ModelRunner returns None elsewhere); the sampled tokens are
copied to the host here, once per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from splitserve_contracts.output_types import (
    LogprobsTable,
    ModelRunnerOutput,
    RequestLogprobs,
    StepStatus,
    StepTimings,
)
from worker_svc.runner.input_batch import InputBatch
from worker_svc.runner.spec_decode import Verified
from worker_svc.runner.step_inputs import StepInputs, ragged_cols
from worker_svc.sample.logprobs import split_tables
from worker_svc.sample.sampler import SamplerOutput


@dataclass(frozen=True, slots=True)
class Sampled:
    """A step's sampler output, and what verifying its drafts kept (None: no drafts)."""

    output: SamplerOutput
    verified: Verified | None = None


def append_sampled(batch: InputBatch, inputs: StepInputs, sampled: Sampled) -> None:
    """Async scheduling: a sampling rank appends its sampled tokens to its requests at once
    (the next step takes them as inputs before the core knows them); in lockstep the next
    step's diff brings them."""
    rows = inputs.rows[inputs.sampling_reqs]
    if sampled.verified is not None:
        verified = sampled.verified
        batch.append_sampled(rows, verified.token_ids, verified.num_sampled)
    else:
        batch.append_sampled(rows, sampled.output.sampled_token_ids.cpu().numpy())


def step_output(
    step_id: int,
    rank: int,
    started: float,
    timings: StepTimings,
    prompt_tables: dict[int, LogprobsTable],
    batch: InputBatch | None,
    failed: dict[int, str],
) -> ModelRunnerOutput:
    """The step's output without its sampled tokens: its timings (the total up to now, from
    `started`), the prompt logprobs that completed, the KV blocks in use, the refused requests."""
    return ModelRunnerOutput(
        step_id=step_id,
        status=StepStatus.OK,
        rank=rank,
        prompt_logprobs=[RequestLogprobs(h, t) for h, t in prompt_tables.items()],
        timings=StepTimings(
            timings.prepare_inputs_seconds,
            timings.forward_seconds,
            timings.sample_seconds,
            total_seconds=time.perf_counter() - started,
        ),
        num_used_kv_blocks=batch.num_used_blocks() if batch is not None else 0,
        failed_req_handles=list(failed),
        failed_reasons=list(failed.values()),
    )


def add_sampled(
    output: ModelRunnerOutput, inputs: StepInputs, sampled: Sampled, batch: InputBatch | None
) -> None:
    """The sampling requests' tokens (with drafts: the ones each kept, and its drafts' count)
    and the logprobs of those that asked."""
    handles = inputs.req_handles[inputs.sampling_reqs]
    output.req_handles = handles.tolist()
    verified = sampled.verified
    if verified is None:
        tokens = sampled.output.sampled_token_ids.cpu().numpy()
        output.sampled_token_ids = tokens.astype(np.int64).tolist()
    else:
        assert inputs.num_drafts is not None
        output.sampled_token_ids = verified.token_ids.tolist()
        output.num_sampled_token_ids = verified.num_sampled.tolist()
        output.num_draft_tokens = inputs.num_drafts.tolist()
    output.logprobs = sample_logprobs(inputs, handles, sampled, batch)


def sample_logprobs(
    inputs: StepInputs, handles: np.ndarray, sampled: Sampled, batch: InputBatch | None
) -> list[RequestLogprobs]:
    """The chosen tokens' logprobs of the requests that asked: one row per output token."""
    logprobs = sampled.output.logprobs
    if logprobs is None:
        return []
    assert batch is not None
    num_tops = batch.sampling.num_logprobs[inputs.rows[inputs.sampling_reqs]]
    wanted = np.flatnonzero(num_tops >= 0)
    verified = sampled.verified
    counts = np.ones(len(wanted), np.int64)
    logits_rows = wanted
    if verified is not None:
        starts = np.cumsum(verified.num_sampled) - verified.num_sampled
        counts = verified.num_sampled[wanted]
        logits_rows = verified.logits_rows[ragged_cols(starts[wanted], counts)]
    ids, values, ranks = (t[torch.from_numpy(logits_rows)] for t in logprobs)
    tables = split_tables(ids, values, ranks, counts.tolist(), num_tops[wanted].tolist())
    return [RequestLogprobs(h, t) for h, t in zip(handles[wanted].tolist(), tables, strict=True)]

"""Prompt log-probabilities across (possibly chunked) prefill steps.

The logits at prompt position p score prompt token p + 1, so a chunk covering positions
[start, end) yields rows for tokens start + 1 .. min(end, P - 1). Rows collect per request
until its prefill completes; then the whole table (positions 1 .. P - 1 that this rank
computed: a prefix-cache hit skips the cached ones) is delivered once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from splitserve_contracts.output_types import LogprobsTable
from worker_svc.runner.input_batch import InputBatch
from worker_svc.runner.step_inputs import StepInputs
from worker_svc.sample.logprobs import compute_logprobs, concat_tables, split_tables

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class PromptLogprobsPlan:
    """The step's prompt positions to score: flat token indices and the tokens they predict."""

    token_index: IntArray
    target_ids: IntArray
    handles: list[int]
    counts: list[int]
    num_tops: list[int]


@dataclass(slots=True)
class PromptLogprobsCollector:
    """Pending tables per request handle, and the handles already served."""

    pending: dict[int, list[LogprobsTable]] = field(default_factory=dict)
    delivered: set[int] = field(default_factory=set)

    def plan(self, batch: InputBatch, inputs: StepInputs) -> PromptLogprobsPlan | None:
        wants = batch.sampling.num_prompt_logprobs[inputs.rows] >= 0
        if not wants.any():
            return None
        parts: list[tuple[IntArray, IntArray]] = []
        handles, counts, num_tops = [], [], []
        for i in np.flatnonzero(wants).tolist():
            row, handle = int(inputs.rows[i]), int(inputs.req_handles[i])
            if handle in self.delivered:
                continue
            q_start, q_end = int(inputs.query_start_loc[i]), int(inputs.query_start_loc[i + 1])
            first_pos = int(inputs.seq_lens[i]) - (q_end - q_start)
            last_pos = min(int(inputs.seq_lens[i]), int(batch.num_prompt_tokens[row]) - 1)
            positions = np.arange(first_pos, max(first_pos, last_pos))
            parts.append((q_start + positions - first_pos, batch.token_ids[row, positions + 1]))
            handles.append(handle)
            counts.append(len(positions))
            num_tops.append(int(batch.sampling.num_prompt_logprobs[row]))
        if not handles:
            return None
        return PromptLogprobsPlan(
            token_index=np.concatenate([p[0] for p in parts]).astype(np.int64),
            target_ids=np.concatenate([p[1] for p in parts]).astype(np.int64),
            handles=handles,
            counts=counts,
            num_tops=num_tops,
        )

    def collect(self, plan: PromptLogprobsPlan, logits: torch.Tensor) -> None:
        """Score the planned positions from their raw logits and keep the rows."""
        targets = torch.from_numpy(plan.target_ids).to(logits.device)
        ids, values, ranks = compute_logprobs(
            torch.log_softmax(logits, dim=-1), targets, max(plan.num_tops)
        )
        tables = split_tables(ids, values, ranks, plan.counts, plan.num_tops)
        for handle, table in zip(plan.handles, tables, strict=True):
            self.pending.setdefault(handle, []).append(table)

    def take_finished(
        self, plan: PromptLogprobsPlan | None, sampled: set[int]
    ) -> dict[int, LogprobsTable]:
        """Tables of the planned requests that sampled this step (their prefill is complete)."""
        if plan is None:
            return {}
        done = {}
        for handle, num_top in zip(plan.handles, plan.num_tops, strict=True):
            if handle in sampled:
                done[handle] = concat_tables(self.pending.pop(handle, []), num_top)
                self.delivered.add(handle)
        return done

    def forget(self, handles: list[int]) -> None:
        for handle in handles:
            self.pending.pop(handle, None)
            self.delivered.discard(handle)

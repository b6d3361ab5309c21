"""The records of one step on a rank: what update_states made of it (StepPlan) and the model's
host-side inputs (StepInputs), with the ragged-run helpers that build them without a Python loop
per token (worker_svc/runner/input_batch.py fills them from the rank's per-request tables)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class StepInputs:
    """Host-side inputs of one step; requests in scheduled order (new, then cached).

    Token t belongs to request `token_req[t]`; `logits_indices` are the last tokens of the
    requests that sample (`sampling_reqs`), i.e. whose prefill is complete after this step.
    """

    rows: IntArray
    req_handles: IntArray
    input_ids: IntArray
    positions: IntArray
    slot_mapping: IntArray
    query_start_loc: IntArray
    seq_lens: IntArray
    block_tables: IntArray
    logits_indices: IntArray
    sampling_reqs: IntArray
    num_drafts: IntArray | None = None
    """Speculative decoding: drafts each sampling request verifies (its logits rows are its last
    1 + num_drafts tokens, in logits_indices); None: none in this step, one row each."""

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])


@dataclass(slots=True)
class StepPlan:
    """What update_states made of a step: the rows this rank runs, in scheduled order, with
    their scheduled tokens; the fresh block ids to zero; the requests it refused, and why."""

    rows: IntArray
    num_scheduled_tokens: IntArray
    fresh_block_ids: IntArray
    failed: dict[int, str]
    num_spec: IntArray | None = None
    """Draft slots per row (speculative decoding; None: none in this step). Once the drafts are
    proposed (worker_svc/runner/spec_decode.py), the drafts each row verifies: its
    num_scheduled_tokens are then 1 + that."""
    fresh_state_slots: IntArray = field(default_factory=lambda: np.zeros(0, np.int64))
    """State slots given to requests in this step (new or resumed): zeroed before it runs."""

    def reordered(self, order: IntArray) -> StepPlan:
        """The same step with its rows in `order` (a permutation of their indices)."""
        num_spec = None if self.num_spec is None else self.num_spec[order]
        return StepPlan(
            self.rows[order],
            self.num_scheduled_tokens[order],
            self.fresh_block_ids,
            self.failed,
            num_spec,
            self.fresh_state_slots,
        )


def append_runs(
    table: np.ndarray, lengths: IntArray, rows: IntArray, counts: IntArray, values: IntArray
) -> None:
    """table[row, lengths[row] + j] = values[...] for each row's run of `counts` values (checked
    beforehand: they fit)."""
    if len(values):
        table[np.repeat(rows, counts), ragged_cols(lengths[rows], counts)] = values
    lengths[rows] += counts


def ragged_cols(starts: IntArray, counts: IntArray) -> IntArray:
    """For ragged runs of lengths `counts`, column starts[i] + j of every element j of run i."""
    run_starts = np.cumsum(counts) - counts
    return np.repeat(starts - run_starts, counts) + np.arange(int(counts.sum()))

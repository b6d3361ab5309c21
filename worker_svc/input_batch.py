"""Per-request state that persists on a rank across steps, and each step's model inputs.

Every live request owns a row of fixed-width numpy tables: its token ids (prompt, then outputs
as the engine core reports them), its KV block ids and its counters. A step's diffs update
rows in bulk: ragged appends become one fancy-index assignment over the concatenated ids.
Input preparation is vectorized over the step's tokens the same way (vLLM's
`_prepare_inputs`): no Python loop runs per token.

Invariants per row: num_computed_tokens <= num_tokens <= max_model_len, and the row's first
num_blocks block ids are its KV blocks in sequence order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from worker_svc.kv_cache import NULL_BLOCK_ID
from worker_svc.sampling_metadata import SamplingStates
from worker_svc.scheduler_output import NewRequestData, SchedulerOutput

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

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])


def _ragged_cols(starts: IntArray, counts: IntArray) -> IntArray:
    """For ragged runs of lengths `counts`, column starts[i] + j of every element j of run i."""
    run_starts = np.cumsum(counts) - counts
    return np.repeat(starts - run_starts, counts) + np.arange(int(counts.sum()))


class InputBatch:
    """The rank's table of live requests, keyed by the engine core's request handles."""

    def __init__(
        self,
        *,
        max_model_len: int,
        block_size: int,
        vocab_size: int,
        num_kv_blocks: int,
        capacity: int,
        sampling: SamplingStates,
    ) -> None:
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.num_kv_blocks = num_kv_blocks
        """Blocks in the rank's cache; a request's blocks are 1..num_kv_blocks - 1 (block 0
        is the null block)."""
        self.max_blocks_per_req = -(-max_model_len // block_size)
        self.sampling = sampling
        self.handle_to_row: dict[int, int] = {}
        self.row_handles: dict[int, int] = {}
        self.free_rows: list[int] = []
        self.capacity = 0
        self.token_ids = np.zeros((0, max_model_len), np.int32)
        self.block_table = np.zeros((0, self.max_blocks_per_req), np.int64)
        self.num_tokens = np.zeros(0, np.int64)
        self.num_prompt_tokens = np.zeros(0, np.int64)
        self.num_computed_tokens = np.zeros(0, np.int64)
        self.num_blocks = np.zeros(0, np.int64)
        self._grow(capacity)

    @property
    def num_reqs(self) -> int:
        return len(self.handle_to_row)

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        for name in (
            "token_ids",
            "block_table",
            "num_tokens",
            "num_prompt_tokens",
            "num_computed_tokens",
            "num_blocks",
        ):
            array = getattr(self, name)
            grown = np.zeros((capacity, *array.shape[1:]), array.dtype)
            grown[:old] = array
            setattr(self, name, grown)
        if old:
            self.sampling.grow(capacity)
        self.free_rows.extend(range(capacity - 1, old - 1, -1))
        self.capacity = capacity

    def _row(self, handle: int) -> int:
        try:
            return self.handle_to_row[handle]
        except KeyError:
            raise ValueError(f"request handle {handle} is unknown to this rank") from None

    # -- state updates from the step's diffs ---------------------------------------------------

    def update_states(self, step: SchedulerOutput) -> tuple[IntArray, IntArray]:
        """Apply the step's diffs. Returns (rows in scheduled order, freshly assigned block ids
        that hold no computed token and must be zeroed before use)."""
        for handle in step.finished_req_handles.tolist():
            row = self.handle_to_row.pop(handle, None)
            if row is not None:
                del self.row_handles[row]
                self.sampling.remove(row)
                self.free_rows.append(row)
        new_rows = [self._add_request(new) for new in step.scheduled_new_reqs]
        cached = step.scheduled_cached_reqs
        rows = np.asarray(new_rows + [self._row(h) for h in cached.req_handles.tolist()], np.int64)
        if len(np.unique(rows)) != len(rows):
            raise ValueError("a request handle is scheduled twice in one step")
        cached_rows = rows[len(new_rows) :]
        first_fresh = -(-self.num_computed_tokens[rows[: len(new_rows)]] // self.block_size)
        fresh = [
            self.block_table[r, f : self.num_blocks[r]]
            for r, f in zip(new_rows, first_fresh, strict=True)
        ]
        if cached.num_reqs:
            fresh.append(self._update_cached(cached_rows, step))
        return rows, np.unique(np.concatenate(fresh)) if fresh else np.zeros(0, np.int64)

    def _add_request(self, new: NewRequestData) -> int:
        if new.req_handle in self.handle_to_row:
            raise ValueError(f"request handle {new.req_handle} is already known to this rank")
        num_prompt = len(new.prompt_token_ids)
        if not 0 < num_prompt <= self.max_model_len:
            raise ValueError(
                f"request {new.request_id!r}: prompt of {num_prompt} tokens does not "
                f"fit max_model_len {self.max_model_len}"
            )
        for what, ids in (("prompt", new.prompt_token_ids), ("stop", new.stop_token_ids)):
            if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
                raise ValueError(
                    f"request {new.request_id!r}: {what} token id outside the vocabulary"
                )
        if not 0 <= new.num_computed_tokens < num_prompt:
            raise ValueError(
                f"request {new.request_id!r}: {new.num_computed_tokens} computed "
                f"tokens for a prompt of {num_prompt}"
            )
        if not self.free_rows:
            self._grow(2 * self.capacity)
        row = self.free_rows.pop()
        self.handle_to_row[new.req_handle] = row
        self.row_handles[row] = new.req_handle
        self.token_ids[row, :num_prompt] = new.prompt_token_ids
        self.num_tokens[row] = self.num_prompt_tokens[row] = num_prompt
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.num_blocks[row] = 0
        self._append(
            self.block_table,
            self.num_blocks,
            np.array([row]),
            np.array([len(new.block_ids)]),
            new.block_ids,
            "block ids",
        )
        self.sampling.add(row, new.sampling, new.stop_token_ids, new.min_tokens)
        return row

    def _update_cached(self, rows: IntArray, step: SchedulerOutput) -> IntArray:
        cached = step.scheduled_cached_reqs
        resumed = np.asarray([self._row(h) for h in cached.resumed_req_handles.tolist()], np.int64)
        self.num_blocks[resumed] = 0  # resumed requests replace their block list
        self.num_computed_tokens[rows] = cached.num_computed_tokens
        first_new = self.num_blocks[rows].copy()
        self._append(
            self.block_table,
            self.num_blocks,
            rows,
            cached.num_new_block_ids,
            cached.new_block_ids,
            "block ids",
        )
        self._append(
            self.token_ids,
            self.num_tokens,
            rows,
            cached.num_new_token_ids,
            cached.new_token_ids,
            "tokens",
        )
        if len(resumed):
            self.num_tokens[resumed] = 0  # and rebuild their tokens from scratch
            self._append(
                self.token_ids,
                self.num_tokens,
                resumed,
                cached.num_resumed_token_ids,
                cached.resumed_all_token_ids,
                "tokens",
            )
        # New blocks at or past the first block without computed tokens are fresh.
        first_fresh = -(-self.num_computed_tokens[rows] // self.block_size)
        cols = _ragged_cols(first_new, cached.num_new_block_ids)
        is_fresh = cols >= np.repeat(first_fresh, cached.num_new_block_ids)
        return cached.new_block_ids[is_fresh]

    def _append(
        self,
        table: np.ndarray,
        lengths: IntArray,
        rows: IntArray,
        counts: IntArray,
        values: IntArray,
        what: str,
    ) -> None:
        """table[row, lengths[row] + j] = values[...] for each row's run of `counts` values."""
        if len(counts) != len(rows) or int(counts.sum()) != len(values):
            raise ValueError(f"malformed step: {what} counts do not match their values")
        if not len(values):
            return
        is_blocks = table is self.block_table
        low, limit = (NULL_BLOCK_ID + 1, self.num_kv_blocks) if is_blocks else (0, self.vocab_size)
        if int(values.min()) < low or int(values.max()) >= limit:
            raise ValueError(f"{what} outside {low}..{limit - 1}")
        cols = _ragged_cols(lengths[rows], counts)
        if int(cols.max()) >= table.shape[1]:
            raise ValueError(f"{what} exceed the per-request limit of {table.shape[1]}")
        table[np.repeat(rows, counts), cols] = values
        lengths[rows] += counts

    # -- step inputs ---------------------------------------------------------------------------

    def prepare_inputs(self, step: SchedulerOutput, rows: IntArray) -> StepInputs:
        """Token ids, positions, slots and per-request metadata of the step, all vectorized."""
        num_scheduled = step.num_scheduled_tokens
        self._check_schedule(step, rows)
        num_computed = self.num_computed_tokens[rows]
        seq_lens = num_computed + num_scheduled
        query_start_loc = np.concatenate([[0], np.cumsum(num_scheduled)])
        token_rows = np.repeat(rows, num_scheduled)
        positions = _ragged_cols(num_computed, num_scheduled)
        bs = self.block_size
        slot_mapping = self.block_table[token_rows, positions // bs] * bs + positions % bs
        num_blocks = -(-seq_lens // bs)
        max_blocks = int(num_blocks.max())
        block_tables = np.where(
            np.arange(max_blocks)[None, :] < num_blocks[:, None],
            self.block_table[rows, :max_blocks],
            NULL_BLOCK_ID,
        )
        sampling_reqs = np.flatnonzero(seq_lens == self.num_tokens[rows])
        return StepInputs(
            rows=rows,
            req_handles=np.asarray([self.row_handles[r] for r in rows.tolist()], np.int64),
            input_ids=self.token_ids[token_rows, positions].astype(np.int64),
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            logits_indices=query_start_loc[sampling_reqs + 1] - 1,
            sampling_reqs=sampling_reqs,
        )

    def _check_schedule(self, step: SchedulerOutput, rows: IntArray) -> None:
        num_scheduled = step.num_scheduled_tokens
        if len(num_scheduled) != len(rows):
            raise ValueError(
                f"num_scheduled_tokens has {len(num_scheduled)} entries for "
                f"{len(rows)} scheduled requests"
            )
        if int(num_scheduled.sum()) != step.total_num_scheduled_tokens:
            raise ValueError("total_num_scheduled_tokens is not the sum of num_scheduled_tokens")
        if len(rows) and int(num_scheduled.min()) < 1:
            raise ValueError("a scheduled request has no tokens to compute")
        seq_lens = self.num_computed_tokens[rows] + num_scheduled
        bad = np.flatnonzero(
            (seq_lens > self.num_tokens[rows])
            | (seq_lens > self.num_blocks[rows] * self.block_size)
        )
        if len(bad):
            i = int(bad[0])
            raise ValueError(
                f"request handle {self.row_handles[int(rows[i])]}: {int(seq_lens[i])} tokens "
                f"scheduled, but it has {int(self.num_tokens[rows[i]])} tokens and "
                f"{int(self.num_blocks[rows[i]])} blocks of {self.block_size}"
            )

    def finish_step(self, inputs: StepInputs) -> None:
        """Record that the step's tokens now have KV."""
        self.num_computed_tokens[inputs.rows] = inputs.seq_lens

    def num_used_blocks(self) -> int:
        """Distinct blocks holding at least one computed token of a live request."""
        if not self.handle_to_row:
            return 0
        live = np.fromiter(self.handle_to_row.values(), np.int64, len(self.handle_to_row))
        num_blocks = -(-self.num_computed_tokens[live] // self.block_size)
        width = int(num_blocks.max())
        used = np.arange(width)[None, :] < num_blocks[:, None]
        return len(np.unique(self.block_table[live, :width][used]))

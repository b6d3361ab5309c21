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

from splitserve_contracts import sampling_rules
from splitserve_contracts.sampling_rules import InvalidSamplingParams
from worker_svc.kv_cache import NULL_BLOCK_ID
from worker_svc.sampling_metadata import SamplingStates
from worker_svc.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from worker_svc.step_checks import BoolArray, bad_runs, check_step_shape, select_cached

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
    proposed (worker_svc/spec_decode.py), the drafts each row verifies: its
    num_scheduled_tokens are then 1 + that."""

    def reordered(self, order: IntArray) -> StepPlan:
        """The same step with its rows in `order` (a permutation of their indices)."""
        num_spec = None if self.num_spec is None else self.num_spec[order]
        return StepPlan(
            self.rows[order],
            self.num_scheduled_tokens[order],
            self.fresh_block_ids,
            self.failed,
            num_spec,
        )


def _append_runs(
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
        is_pooling: bool = False,
    ) -> None:
        self.is_pooling = is_pooling
        """The rank serves a pooling model: it takes pooling requests only (and the reverse)."""
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
        self.lora_ids = np.zeros(0, np.int64)
        """The LoRA adapter each row runs with (0: the base model)."""
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
            "lora_ids",
        ):
            array = getattr(self, name)
            grown = np.zeros((capacity, *array.shape[1:]), array.dtype)
            grown[:old] = array
            setattr(self, name, grown)
        if old:
            self.sampling.grow(capacity)
        self.free_rows.extend(range(capacity - 1, old - 1, -1))
        self.capacity = capacity

    # -- state updates from the step's diffs ---------------------------------------------------

    def update_states(self, step: SchedulerOutput) -> StepPlan:
        """Check the step, then apply its diffs. Requests whose own data is wrong are refused
        (no state kept, reported in the plan); a step whose columns do not line up raises
        MalformedStep before anything changes."""
        check_step_shape(step)
        for handle in step.finished_req_handles.tolist():
            self._remove(handle)
        failed: dict[int, str] = {}
        keep = np.ones(step.num_reqs, np.bool_)
        new_rows: list[int] = []
        for i, new in enumerate(step.scheduled_new_reqs):
            problem = self._new_request_problem(new)
            if problem is None:
                new_rows.append(self._add_request(new))
            else:
                failed[new.req_handle], keep[i] = problem, False
        fresh = [self._fresh_blocks(row) for row in new_rows]
        cached_keep = self._check_cached(step.scheduled_cached_reqs, failed)
        keep[len(step.scheduled_new_reqs) :] = cached_keep
        cached = select_cached(step.scheduled_cached_reqs, cached_keep)
        cached_rows = np.asarray([self.handle_to_row[h] for h in cached.req_handles.tolist()])
        if cached.num_reqs:
            fresh.append(self._update_cached(cached_rows.astype(np.int64), cached))
        rows = np.concatenate([np.asarray(new_rows, np.int64), cached_rows.astype(np.int64)])
        fresh_ids = np.unique(np.concatenate(fresh)) if fresh else np.zeros(0, np.int64)
        num_spec = step.num_spec_tokens[keep] if len(step.num_spec_tokens) else None
        plan = StepPlan(rows, step.num_scheduled_tokens[keep], fresh_ids, failed, num_spec)
        return self._check_schedule(plan)

    def _fresh_blocks(self, row: int) -> IntArray:
        """A new request's blocks past its prefix-cache hit: they hold no computed token."""
        first_fresh = -(-int(self.num_computed_tokens[row]) // self.block_size)
        return self.block_table[row, first_fresh : self.num_blocks[row]]

    def _remove(self, handle: int) -> None:
        row = self.handle_to_row.pop(handle, None)
        if row is not None:
            del self.row_handles[row]
            self.sampling.remove(row)
            self.free_rows.append(row)

    def _new_request_problem(self, new: NewRequestData) -> str | None:
        """Why this rank cannot take the new request, or None."""
        if new.req_handle in self.handle_to_row:
            return f"request handle {new.req_handle} is already known to this rank"
        if bool(new.pooling_task) != self.is_pooling:
            model = "a pooling" if self.is_pooling else "a generative"
            return f"this rank serves {model} model; pooling_task {new.pooling_task!r} does not fit"
        num_prompt = len(new.prompt_token_ids)
        num_tokens = num_prompt + len(new.output_token_ids)
        if not 0 < num_prompt <= num_tokens <= self.max_model_len:
            return (
                f"{num_tokens} tokens (prompt and outputs) do not fit max_model_len "
                f"{self.max_model_len}"
            )
        for what, ids in (
            ("prompt", new.prompt_token_ids),
            ("output", new.output_token_ids),
            ("stop", new.stop_token_ids),
        ):
            if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
                return f"{what} token id outside the vocabulary"
        if not 0 <= new.num_computed_tokens < num_tokens:
            return f"{new.num_computed_tokens} computed tokens for a request of {num_tokens}"
        blocks = new.block_ids
        if (
            len(blocks) > self.max_blocks_per_req
            or bad_runs(
                np.array([len(blocks)]), blocks, NULL_BLOCK_ID + 1, self.num_kv_blocks
            ).any()
        ):
            return f"block ids outside {NULL_BLOCK_ID + 1}..{self.num_kv_blocks - 1} or too many"
        try:
            sampling_rules.validate(new.sampling, self.sampling.limits)
        except InvalidSamplingParams as err:
            return str(err)
        return None

    def _add_request(self, new: NewRequestData) -> int:
        """Store a checked new request in a free row."""
        if not self.free_rows:
            self._grow(2 * self.capacity)
        row = self.free_rows.pop()
        num_prompt = len(new.prompt_token_ids)
        num_outputs = len(new.output_token_ids)
        self.handle_to_row[new.req_handle] = row
        self.row_handles[row] = new.req_handle
        self.token_ids[row, :num_prompt] = new.prompt_token_ids
        self.token_ids[row, num_prompt : num_prompt + num_outputs] = new.output_token_ids
        self.num_prompt_tokens[row] = num_prompt
        self.num_tokens[row] = num_prompt + num_outputs
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.num_blocks[row] = len(new.block_ids)
        self.block_table[row, : len(new.block_ids)] = new.block_ids
        self.lora_ids[row] = new.lora_id
        self.sampling.add(row, new.sampling, new.stop_token_ids, new.min_tokens, num_outputs)
        return row

    def _check_cached(self, cached: CachedRequestData, failed: dict[int, str]) -> BoolArray:
        """Which cached entries can be applied; the others are refused (state dropped)."""
        handles = cached.req_handles.tolist()
        is_known = np.array([h in self.handle_to_row for h in handles], np.bool_)
        rows = np.array([self.handle_to_row.get(h, 0) for h in handles], np.int64)
        is_resumed = np.isin(cached.req_handles, cached.resumed_req_handles)
        held = np.where(is_resumed, 0, self.num_blocks[rows])
        resumed_lens = np.zeros(len(handles), np.int64)
        resumed_bad = bad_runs(
            cached.num_resumed_token_ids, cached.resumed_all_token_ids, 0, self.vocab_size
        )
        for handle, length, bad in zip(
            cached.resumed_req_handles.tolist(),
            cached.num_resumed_token_ids.tolist(),
            resumed_bad.tolist(),
            strict=True,
        ):
            resumed_lens[handles.index(handle)] = -1 if bad or length == 0 else length
        checks = [
            (~is_known, "the request is unknown to this rank"),
            (
                bad_runs(cached.num_new_block_ids, cached.new_block_ids, 1, self.num_kv_blocks)
                | (held + cached.num_new_block_ids > self.max_blocks_per_req),
                f"block ids outside 1..{self.num_kv_blocks - 1} or more than a request holds",
            ),
            (
                bad_runs(cached.num_new_token_ids, cached.new_token_ids, 0, self.vocab_size)
                | (self.num_tokens[rows] + cached.num_new_token_ids > self.max_model_len),
                "new token ids outside the vocabulary or beyond max_model_len",
            ),
            (
                (resumed_lens < 0) | (resumed_lens > self.max_model_len),
                "a resumed request's token ids are empty, too many or outside the vocabulary",
            ),
            (cached.num_computed_tokens < 0, "negative num_computed_tokens"),
        ]
        keep = np.ones(len(handles), np.bool_)
        for is_bad, reason in checks:
            for i in np.flatnonzero(is_bad & keep).tolist():
                failed[handles[i]], keep[i] = reason, False
                if is_known[i]:
                    self._remove(handles[i])
        return keep

    def _update_cached(self, rows: IntArray, cached: CachedRequestData) -> IntArray:
        """Apply checked diffs; returns the new block ids that hold no computed token."""
        resumed = np.asarray(
            [self.handle_to_row[h] for h in cached.resumed_req_handles.tolist()], np.int64
        )
        self.num_blocks[resumed] = 0  # resumed requests replace their block list
        # A running request's count may run ahead of this rank's by draft slots it rejected
        # (async scheduling schedules as if every draft were accepted): the lower one holds.
        own = np.where(
            np.isin(rows, resumed), cached.num_computed_tokens, self.num_computed_tokens[rows]
        )
        self.num_computed_tokens[rows] = np.minimum(cached.num_computed_tokens, own)
        first_new = self.num_blocks[rows].copy()
        _append_runs(self.block_table, self.num_blocks, rows, cached.num_new_block_ids,
                     cached.new_block_ids)  # fmt: skip
        _append_runs(self.token_ids, self.num_tokens, rows, cached.num_new_token_ids,
                     cached.new_token_ids)  # fmt: skip
        if len(resumed):
            self.num_tokens[resumed] = 0  # and rebuild their tokens from scratch
            _append_runs(self.token_ids, self.num_tokens, resumed,
                         cached.num_resumed_token_ids, cached.resumed_all_token_ids)  # fmt: skip
            for row in resumed.tolist():
                num_outputs = int(self.num_tokens[row] - self.num_prompt_tokens[row])
                self.sampling.resync_generator(row, num_outputs)
        # New blocks at or past the first block without computed tokens are fresh.
        first_fresh = -(-self.num_computed_tokens[rows] // self.block_size)
        cols = ragged_cols(first_new, cached.num_new_block_ids)
        is_fresh = cols >= np.repeat(first_fresh, cached.num_new_block_ids)
        return cached.new_block_ids[is_fresh]

    # -- step inputs ---------------------------------------------------------------------------

    def _check_schedule(self, plan: StepPlan) -> StepPlan:
        """Refuse requests whose scheduled tokens they do not have (or have no blocks for)."""
        rows, num_scheduled, num_spec = plan.rows, plan.num_scheduled_tokens, plan.num_spec
        num_computed = self.num_computed_tokens[rows]
        seq_lens = num_computed + num_scheduled
        num_known = self.num_tokens[rows]
        is_bad = (seq_lens > self.num_blocks[rows] * self.block_size) | (num_scheduled < 1)
        if num_spec is None:
            is_bad |= seq_lens > num_known
        else:  # draft slots follow a decode's one known token
            is_decode = num_known - num_computed == 1
            is_bad |= (seq_lens - num_spec > num_known) | ((num_spec > 0) & ~is_decode)
            is_bad |= (num_spec < 0) | (num_spec >= num_scheduled)
        if not is_bad.any():
            return plan
        reasons = {
            i: (
                f"{int(num_scheduled[i])} tokens scheduled after "
                f"{self.num_computed_tokens[rows[i]]}, but it has "
                f"{int(self.num_tokens[rows[i]])} tokens and {int(self.num_blocks[rows[i]])} "
                f"blocks of {self.block_size}"
            )
            for i in np.flatnonzero(is_bad).tolist()
        }
        return self.refuse(plan, reasons)

    def refuse(self, plan: StepPlan, reasons: dict[int, str]) -> StepPlan:
        """The plan without its entries `reasons` names (by index), whose requests are
        dropped and reported as failed with their reason."""
        keep = np.ones(len(plan.rows), np.bool_)
        for i, reason in reasons.items():
            handle = self.row_handles[int(plan.rows[i])]
            plan.failed[handle] = reason
            self._remove(handle)
            keep[i] = False
        num_spec = plan.num_spec
        return StepPlan(
            plan.rows[keep],
            plan.num_scheduled_tokens[keep],
            plan.fresh_block_ids,
            plan.failed,
            None if num_spec is None else num_spec[keep],
        )

    def prepare_inputs(self, plan: StepPlan) -> StepInputs:
        """Token ids, positions, slots and per-request metadata of the step, all vectorized."""
        rows, num_scheduled = plan.rows, plan.num_scheduled_tokens
        num_computed = self.num_computed_tokens[rows]
        seq_lens = num_computed + num_scheduled
        query_start_loc = np.concatenate([[0], np.cumsum(num_scheduled)])
        token_rows = np.repeat(rows, num_scheduled)
        positions = ragged_cols(num_computed, num_scheduled)
        bs = self.block_size
        slot_mapping = self.block_table[token_rows, positions // bs] * bs + positions % bs
        num_blocks = -(-seq_lens // bs)
        max_blocks = int(num_blocks.max())
        block_tables = np.where(
            np.arange(max_blocks)[None, :] < num_blocks[:, None],
            self.block_table[rows, :max_blocks],
            NULL_BLOCK_ID,
        )
        num_drafts = plan.num_spec
        if num_drafts is None:
            sampling_reqs = np.flatnonzero(seq_lens == self.num_tokens[rows])
            logits_indices = query_start_loc[sampling_reqs + 1] - 1
        else:  # a row verifying drafts samples at each of its last 1 + num_drafts tokens
            sampling_reqs = np.flatnonzero(seq_lens - num_drafts == self.num_tokens[rows])
            num_drafts = num_drafts[sampling_reqs]
            num_logits = num_drafts + 1
            logits_indices = ragged_cols(
                query_start_loc[sampling_reqs + 1] - num_logits, num_logits
            )
        return StepInputs(
            rows=rows,
            req_handles=np.asarray([self.row_handles[r] for r in rows.tolist()], np.int64),
            input_ids=self.token_ids[token_rows, positions].astype(np.int64),
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            logits_indices=logits_indices,
            sampling_reqs=sampling_reqs,
            num_drafts=num_drafts,
        )

    def finish_step(self, inputs: StepInputs) -> None:
        """Record that the step's tokens now have KV."""
        self.num_computed_tokens[inputs.rows] = inputs.seq_lens

    def append_sampled(
        self, rows: IntArray, token_ids: np.ndarray, counts: IntArray | None = None
    ) -> None:
        """Async scheduling: the tokens the rows sampled join their tokens now (the engine core
        sends none for them): one each, or the next counts[i] of token_ids for row i; a row
        takes none past max_model_len (it is finished)."""
        if counts is None:
            fits = self.num_tokens[rows] < self.max_model_len
            rows = rows[fits]
            self.token_ids[rows, self.num_tokens[rows]] = token_ids[fits]
            self.num_tokens[rows] += 1
            return
        room = self.max_model_len - self.num_tokens[rows]
        keep = ragged_cols(np.zeros(len(counts), np.int64), counts) < np.repeat(room, counts)
        _append_runs(self.token_ids, self.num_tokens, rows, np.minimum(counts, room),
                     token_ids[keep])  # fmt: skip

    def num_used_blocks(self) -> int:
        """Distinct blocks holding at least one computed token of a live request."""
        if not self.handle_to_row:
            return 0
        live = np.fromiter(self.handle_to_row.values(), np.int64, len(self.handle_to_row))
        num_blocks = -(-self.num_computed_tokens[live] // self.block_size)
        width = int(num_blocks.max())
        used = np.arange(width)[None, :] < num_blocks[:, None]
        return len(np.unique(self.block_table[live, :width][used]))

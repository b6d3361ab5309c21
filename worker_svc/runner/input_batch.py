"""A rank's live requests across steps (their rows: worker_svc/runner/batch_rows.py) and each step's
model inputs.

A step's diffs update rows in bulk: ragged appends become one fancy-index assignment over the
concatenated ids. Input preparation is vectorized over the step's tokens the same way (vLLM's
`_prepare_inputs`): no Python loop runs per token. Every diff is checked first: a request
whose own data is wrong is refused alone, a step whose columns do not line up raises.
"""

from __future__ import annotations

import numpy as np

from splitserve_contracts import sampling_rules
from splitserve_contracts.sampling_rules import InvalidSamplingParams
from worker_svc.runner.batch_rows import BatchRows
from worker_svc.runner.kv_cache import NULL_BLOCK_ID
from worker_svc.runner.step_inputs import IntArray, StepInputs, StepPlan, append_runs, ragged_cols
from worker_svc.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from worker_svc.step_checks import BoolArray, bad_runs, check_step_shape, select_cached


class InputBatch(BatchRows):
    """The rank's live requests (BatchRows), updated by each step's diffs, and the step's
    inputs built from them."""

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
            problem = self._new_request_problem(new) or self.state_slot_problem(
                new.state_slot, new.num_computed_tokens
            )
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
        if self.num_state_slots:
            plan.fresh_state_slots = self._fresh_state_slots(new_rows, cached)
        return self._check_schedule(plan)

    def _fresh_state_slots(self, new_rows: list[int], cached: CachedRequestData) -> IntArray:
        """The slots of the step's new and resumed requests, which start from a zero state."""
        resumed = [self.handle_to_row[h] for h in cached.resumed_req_handles.tolist()]
        return self.state_slots[np.asarray([*new_rows, *resumed], np.int64)]

    def _fresh_blocks(self, row: int) -> IntArray:
        """A new request's blocks past its prefix-cache hit: they hold no computed token."""
        first_fresh = -(-int(self.num_computed_tokens[row]) // self.block_size)
        return self.block_table[row, first_fresh : self.num_blocks[row]]

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
            (self._resumed_slot_problems(cached, handles), "its resumed state slot is wrong"),
        ]
        keep = np.ones(len(handles), np.bool_)
        for is_bad, reason in checks:
            for i in np.flatnonzero(is_bad & keep).tolist():
                failed[handles[i]], keep[i] = reason, False
                if is_known[i]:
                    self._remove(handles[i])
        return keep

    def _resumed_slot_problems(self, cached: CachedRequestData, handles: list[int]) -> BoolArray:
        """Resumed requests whose state slot does not fit (see state_slot_problem)."""
        is_bad = np.zeros(len(handles), np.bool_)
        if not self.num_state_slots and not len(cached.resumed_state_slots):
            return is_bad
        slots = cached.resumed_state_slots.tolist()
        for j, handle in enumerate(cached.resumed_req_handles.tolist()):
            i = handles.index(handle)
            slot = slots[j] if j < len(slots) else 0
            computed = int(cached.num_computed_tokens[i])
            is_bad[i] = self.state_slot_problem(slot, computed) is not None
        return is_bad

    def _update_cached(self, rows: IntArray, cached: CachedRequestData) -> IntArray:
        """Apply checked diffs; returns the new block ids that hold no computed token."""
        resumed = np.asarray(
            [self.handle_to_row[h] for h in cached.resumed_req_handles.tolist()], np.int64
        )
        self.num_blocks[resumed] = 0  # resumed requests replace their block list
        if len(cached.resumed_state_slots):
            self.state_slots[resumed] = cached.resumed_state_slots
        # A running request's count may run ahead of this rank's by draft slots it rejected
        # (async scheduling schedules as if every draft were accepted): the lower one holds.
        own = np.where(
            np.isin(rows, resumed), cached.num_computed_tokens, self.num_computed_tokens[rows]
        )
        self.num_computed_tokens[rows] = np.minimum(cached.num_computed_tokens, own)
        first_new = self.num_blocks[rows].copy()
        append_runs(self.block_table, self.num_blocks, rows, cached.num_new_block_ids,
                     cached.new_block_ids)  # fmt: skip
        append_runs(self.token_ids, self.num_tokens, rows, cached.num_new_token_ids,
                     cached.new_token_ids)  # fmt: skip
        if len(resumed):
            self.num_tokens[resumed] = 0  # and rebuild their tokens from scratch
            append_runs(self.token_ids, self.num_tokens, resumed,
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
        shared = self._shared_state_slots(rows)
        if not is_bad.any() and not shared:
            return plan
        reasons = shared | {
            i: (
                f"{int(num_scheduled[i])} tokens scheduled after "
                f"{self.num_computed_tokens[rows[i]]}, but it has "
                f"{int(self.num_tokens[rows[i]])} tokens and {int(self.num_blocks[rows[i]])} "
                f"blocks of {self.block_size}"
            )
            for i in np.flatnonzero(is_bad).tolist()
        }
        return self.refuse(plan, reasons)

    def _shared_state_slots(self, rows: IntArray) -> dict[int, str]:
        """Entries whose state slot an earlier request of the step has (each reads and writes
        its own; a preempted request's row keeps a slot the core has taken back, harmlessly)."""
        if not self.num_state_slots or not len(rows):
            return {}
        slots = self.state_slots[rows]
        _, first = np.unique(slots, return_index=True)
        shared = np.setdiff1d(np.arange(len(rows)), first)
        return {
            int(i): f"state slot {int(slots[i])} is another request's in this step" for i in shared
        }

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
            plan.fresh_state_slots,
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

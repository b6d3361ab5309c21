"""The rank's per-request columns: one row of fixed-width numpy tables per live request.

A row holds the request's token ids (prompt, then outputs), its KV block ids, its counters and
its LoRA adapter; its sampling state lives in `SamplingStates`, row for row. The tables grow
by doubling when every row is taken. InputBatch (worker_svc/runner/input_batch.py) applies each step's
diffs to these rows and builds the step's inputs from them; this base only stores, frees and
appends.

Invariants per row: num_computed_tokens <= num_tokens <= max_model_len, and the row's first
num_blocks block ids are its KV blocks in sequence order.
"""

from __future__ import annotations

import numpy as np

from worker_svc.runner.step_inputs import IntArray, append_runs, ragged_cols
from worker_svc.sample.sampling_metadata import SamplingStates
from worker_svc.scheduler_output import NewRequestData


class BatchRows:
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
        num_state_slots: int = 0,
    ) -> None:
        self.is_pooling = is_pooling
        self.num_state_slots = num_state_slots
        """State slots of the rank's state cache (a model with state layers), slot 0 the null
        slot; 0: the model has no state layers, and requests carry no slot."""
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
        self.state_slots = np.zeros(0, np.int64)
        """The state slot each row reads and writes (0: none)."""
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
            "state_slots",
        ):
            array = getattr(self, name)
            grown = np.zeros((capacity, *array.shape[1:]), array.dtype)
            grown[:old] = array
            setattr(self, name, grown)
        if old:
            self.sampling.grow(capacity)
        self.free_rows.extend(range(capacity - 1, old - 1, -1))
        self.capacity = capacity

    def _remove(self, handle: int) -> None:
        row = self.handle_to_row.pop(handle, None)
        if row is not None:
            del self.row_handles[row]
            self.sampling.remove(row)
            self.free_rows.append(row)

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
        self.state_slots[row] = new.state_slot
        self.sampling.add(row, new.sampling, new.stop_token_ids, new.min_tokens, num_outputs)
        return row

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
        append_runs(self.token_ids, self.num_tokens, rows, np.minimum(counts, room),
                     token_ids[keep])  # fmt: skip

    def state_slot_problem(self, slot: int, num_computed: int) -> str | None:
        """Why a request cannot take state slot `slot` starting at `num_computed`, or None: a
        model with state layers needs a slot (not 0) and starts from the first token (its
        state cannot skip a prefix). That no two requests of a step share one is checked with
        the step (a preempted request keeps its row, but its slot went back to the core)."""
        if not self.num_state_slots:
            return None if slot == 0 else f"state slot {slot} for a model without state layers"
        if not 0 < slot < self.num_state_slots:
            return f"state slot {slot} outside 1..{self.num_state_slots - 1}"
        if num_computed:
            return f"{num_computed} computed tokens: a request with a state starts at its first"
        return None

    def num_used_blocks(self) -> int:
        """Distinct blocks holding at least one computed token of a live request."""
        if not self.handle_to_row:
            return 0
        live = np.fromiter(self.handle_to_row.values(), np.int64, len(self.handle_to_row))
        num_blocks = -(-self.num_computed_tokens[live] // self.block_size)
        width = int(num_blocks.max())
        used = np.arange(width)[None, :] < num_blocks[:, None]
        return len(np.unique(self.block_table[live, :width][used]))

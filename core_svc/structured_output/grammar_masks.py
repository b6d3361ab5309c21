"""A step's grammar masks, filled by llguidance, at the model's width (config.vocab_size).

The tokenizer llguidance reads has max(model vocabulary, tokenizer ids) ids (vLLM's
`from_tokenizer(tokenizer, max(vocab_size, len(tokenizer)))`): a smaller tokenizer is padded by
llguidance with ids no grammar allows, so its rows are the model's width already. A tokenizer
with more ids than the model (Qwen2's tokenizer adds `<|endoftext|>` after the vocabulary; a
checkpoint's config.vocab_size may also stop short of the tokenizer) keeps its own size: its rows
are filled at its width and cut to the model's, so an id the model cannot emit is never
allowed. A cut row may allow nothing the model can emit (the grammar goes on only through ids
past the model's vocabulary, its end-of-sequence id among them):

- the next token's row: the request's grammar cannot go on with this model, so it fails
  (`StructuredOutputRequest.failure`, INVALID_REQUEST, when the step's token comes back);
- a draft's row, after drafts that do not complete the grammar: the row before it refuses that
  draft (the rank rejects it there, as it rejects a draft the grammar refuses), and so on back;

and it is sent allowing every token, so the rank never samples from logits that are all -inf
(the request's token, or the run past the refused draft, is never applied).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import llguidance
import numpy as np
from llguidance.numpy import (
    fill_next_token_bitmask_par,
    fill_next_token_bitmask_par_with_draft_tokens,
)

from splitserve_contracts.structured_outputs import InvalidStructuredOutputs

if TYPE_CHECKING:
    from core_svc.structured_output.grammar_state import StructuredOutputRequest


class GrammarMasks:
    """Fills the packed masks of a step's constrained requests (busy-loop thread only)."""

    def __init__(self, vocab_size: int, parallel_threshold: int, num_threads: int) -> None:
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self.parallel_threshold = parallel_threshold
        self.num_threads = num_threads
        self.has_wider_tokenizer = False
        """A tokenizer with more ids than the model was built: rows are cut from then on."""
        self._executor: llguidance.LLExecutor | None = None
        self._bitmask = np.zeros((0, self.num_words), np.int32)
        num_used = vocab_size % 32  # of the last word's bits; the others are padding
        padding = (0xFFFFFFFF << num_used) & 0xFFFFFFFF if num_used else 0
        self._padding_bits = np.array([padding], np.uint32).view(np.int32)[0]

    def fill(
        self,
        states: Sequence[StructuredOutputRequest],
        drafts: Sequence[Sequence[int]] = (),
    ) -> bytes:
        """The packed masks of `states`, one row each in order (little-endian int32 words),
        filled by llguidance: one row after another below parallel_threshold rows (as vLLM),
        in parallel from there on. With `drafts` (speculative decoding: each state's
        grammar-valid drafts), a state gets 1 + len(its drafts) rows: the mask of its next
        token, then the mask after each draft (llguidance consumes the drafts and rolls them
        back: the matcher keeps following applied tokens only); those are always filled by
        llguidance's parallel fill, which takes drafts."""
        num_rows = len(states) + sum(len(d) for d in drafts)
        if self._bitmask.shape[0] < num_rows:
            self._bitmask = np.zeros(
                (max(num_rows, 2 * self._bitmask.shape[0]), self.num_words), np.int32
            )
        bitmask = self._bitmask[:num_rows]
        if self.has_wider_tokenizer:
            self._fill_cut(states, list(drafts) or [()] * len(states), bitmask)
        else:
            self._fill(states, drafts, bitmask)
        return self._to_bytes(bitmask)

    def _fill(
        self,
        states: Sequence[StructuredOutputRequest],
        drafts: Sequence[Sequence[int]],
        bitmask: np.ndarray,
    ) -> None:
        """fill's rows, into `bitmask` of the width of the states' tokenizer."""
        if len(bitmask) < self.parallel_threshold and not any(drafts):
            # llguidance's fill_next_token_bitmask, minus its per-row numpy checks and slicing
            # (half the fill's time at batch 32): each matcher writes its row in place
            address, row_bytes = bitmask.ctypes.data, 4 * bitmask.shape[1]
            for row, state in enumerate(states):
                matcher: llguidance.LLMatcher = state.matcher  # type: ignore[assignment]
                matcher.unsafe_compute_mask_ptr(address + row * row_bytes, row_bytes)
            return
        if self._executor is None:
            self._executor = llguidance.LLExecutor(self.num_threads or None)
        if not any(drafts):
            matchers = [(state.matcher, row) for row, state in enumerate(states)]
            fill_next_token_bitmask_par(self._executor, matchers, bitmask)  # type: ignore[arg-type]
            return
        plain, with_drafts, row = [], [], 0
        for state, state_drafts in zip(states, drafts, strict=True):
            if state_drafts:  # llguidance refuses an empty draft list
                with_drafts.append((state.matcher, row, list(state_drafts)))
            else:
                plain.append((state.matcher, row))
            row += 1 + len(state_drafts)
        if with_drafts:
            fill_next_token_bitmask_par_with_draft_tokens(self._executor, with_drafts, bitmask)  # type: ignore[arg-type]
        if plain:
            fill_next_token_bitmask_par(self._executor, plain, bitmask)  # type: ignore[arg-type]

    def _fill_cut(
        self,
        states: Sequence[StructuredOutputRequest],
        drafts: Sequence[Sequence[int]],
        bitmask: np.ndarray,
    ) -> None:
        """fill's rows when some tokenizer is wider than the model: the states of each
        tokenizer width filled together at that width, then cut to the model's; the cut rows
        of a wider tokenizer checked for dead ends (the module docstring)."""
        starts = np.cumsum([0, *(1 + len(d) for d in drafts)])
        by_width: dict[int, list[int]] = {}
        for i, state in enumerate(states):
            width = self.vocab_size if state.template is None else state.template.vocab_size
            by_width.setdefault(width, []).append(i)
        for width, members in by_width.items():
            rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in members])
            filled = np.zeros((len(rows), (width + 31) // 32), np.int32)
            self._fill([states[i] for i in members], [drafts[i] for i in members], filled)
            bitmask[rows] = filled[:, : self.num_words]
            if width > self.vocab_size:
                for i in members:
                    state_rows = bitmask[starts[i] : starts[i + 1]]
                    self._end_dead_rows(states[i], drafts[i], state_rows, width)

    def _end_dead_rows(
        self,
        state: StructuredOutputRequest,
        drafts: Sequence[int],
        rows: np.ndarray,
        width: int,
    ) -> None:
        """A state's cut rows [1 + len(drafts), num_words], edited in place where one allows
        nothing the model can emit (the module docstring)."""
        dead = np.flatnonzero(~self._emits(rows))
        if not len(dead):
            return
        first = int(dead[0])
        if first and _ends_after(state, drafts[:first]):
            rows[first:] = -1  # the grammar is complete there: the run ends at that draft
            return
        while first:  # draft `first` leads where the model cannot go: the row before refuses it
            rows[first:] = -1
            token = drafts[first - 1]
            rows[first - 1].view(np.uint32)[token >> 5] &= ~np.uint32(1 << (token & 31))
            if self._emits(rows[first - 1 : first])[0]:
                return
            first -= 1
        rows[:] = -1
        state.failure = _dead_end(state, self.vocab_size, width)

    def _emits(self, rows: np.ndarray) -> np.ndarray:
        """Per row: whether it allows some id below the model's vocabulary size."""
        last = rows[:, -1] & ~self._padding_bits
        return rows[:, :-1].any(axis=1) | (last != 0)

    def _to_bytes(self, bitmask: np.ndarray) -> bytes:
        """The rows' wire bytes, the last word's padding bits (past the vocabulary) set: a row
        that allows every token is then all -1 words, which the sparse wire form sends as
        nothing (core_svc/structured_output/structured_bitmask.py) and the rank skips."""
        if self._padding_bits:
            bitmask[:, -1] |= self._padding_bits
        return bitmask.astype("<i4", copy=False).tobytes()


def _ends_after(state: StructuredOutputRequest, drafts: Sequence[int]) -> bool:
    """Whether the run ends by `drafts` (tried on a copy of the matcher): the grammar is
    complete after them, or stops before their last (the rows past a stop are not filled)."""
    assert state.matcher is not None
    probe = state.matcher.deep_copy()
    return not probe.consume_tokens(list(drafts)) or probe.is_stopped()


def _dead_end(state: StructuredOutputRequest, vocab_size: int, width: int) -> str:
    """Why a state's grammar cannot go on with a token the model can emit."""
    matcher = state.matcher
    assert matcher is not None
    if matcher.is_error():
        return state.matcher_failure()
    reason = (
        f"the grammar cannot go on with a token the model can emit (its {vocab_size} ids; "
        f"the tokenizer has {width})"
    )
    if matcher.is_accepting():
        reason += ": the output satisfies it, but its end-of-sequence id is past the model's"
    return InvalidStructuredOutputs(reason, state.params.kind).describe()

"""Structured outputs on a rank: the engine core's packed token bitmask applied to the logits of
the constrained requests before sampling (vLLM's apply_grammar_bitmask), so greedy and random
choices and logprobs all see it. Every rank of the output stage applies the same mask to the
same (all-gathered) logits, so tensor-parallel ranks keep sampling identically.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import torch

from worker_svc.kernels.cpu_kernels import CpuKernels
from worker_svc.scheduler_output import GrammarBitmask
from worker_svc.step_checks import MalformedStep

_CEILINGS = np.array([-np.inf, np.inf], np.float32)
"""A token's logit ceiling by its mask bit: -inf disallowed, +inf allowed."""

GrammarSource = Callable[[], GrammarBitmask | None]
"""Waits for the deferred bitmask of the running step (has_pending_grammar)."""


def grammar_bitmask_from_bytes(handles: list[int], data: bytes) -> GrammarBitmask | None:
    """Decode the wire form; MalformedStep when the blob does not split into equal rows."""
    if not handles:
        return None
    if not data or len(data) % (4 * len(handles)):
        raise MalformedStep(
            f"grammar_bitmask: {len(data)} bytes do not split into {len(handles)} int32 rows"
        )
    words = np.frombuffer(data, dtype="<i4").astype(np.int32, copy=False)
    return GrammarBitmask(np.asarray(handles, np.int64), words.reshape(len(handles), -1))


MAX_SPARSE_WORDS = 1 << 26
"""Words a sparse mask may expand to (256 MiB): a peer's num_words cannot make the rank
allocate without bound."""


def grammar_bitmask_from_sparse(
    handles: list[int],
    num_words: int,
    row_defaults: bytes,
    num_listed_words: list[int],
    word_indices: bytes,
    words: bytes,
) -> GrammarBitmask | None:
    """Decode the sparse wire form (worker.v1.SparseGrammarBitmask) into dense rows;
    MalformedStep when its columns do not line up or an index is out of its row."""
    if not handles:
        return None
    num_rows = len(handles)
    if not 0 < num_words <= MAX_SPARSE_WORDS // num_rows:
        raise MalformedStep(
            f"grammar_bitmask.sparse: {num_words} words per row for {num_rows} rows"
        )
    if len(row_defaults) != num_rows or len(num_listed_words) != num_rows:
        raise MalformedStep(
            f"grammar_bitmask.sparse: {len(row_defaults)} row_defaults and "
            f"{len(num_listed_words)} num_listed_words for {num_rows} rows"
        )
    num_listed = np.asarray(num_listed_words, np.int64)
    total = int(num_listed.sum())
    if len(word_indices) != 4 * total or len(words) != 4 * total:
        raise MalformedStep(
            f"grammar_bitmask.sparse: {total} listed words, but {len(word_indices)} bytes of "
            f"word_indices and {len(words)} bytes of words"
        )
    defaults = np.frombuffer(row_defaults, np.uint8)
    indices = np.frombuffer(word_indices, "<u4")
    if defaults.max() > 1 or (total and int(indices.max()) >= num_words):
        raise MalformedStep(
            "grammar_bitmask.sparse: a row default is not 0 or 1, or a word index is past its row"
        )
    allow = defaults == 1
    bitmask = np.zeros((num_rows, num_words), np.int32)
    if allow.any():
        bitmask[allow] = -1
    row_starts = np.repeat(np.arange(0, num_rows * num_words, num_words), num_listed)
    bitmask.reshape(-1)[row_starts + indices] = np.frombuffer(words, "<i4")
    all_allowed = allow & (num_listed == 0)
    return GrammarBitmask(
        np.asarray(handles, np.int64), bitmask, all_allowed if all_allowed.any() else None
    )


def _occurrences(handles: npt.NDArray[np.int64]) -> list[tuple[int, int]]:
    """(handle, how many times it came before) per entry: a request verifying drafts has one
    logits row and one mask row per position, in position order."""
    seen: dict[int, int] = {}
    keys = []
    for handle in handles.tolist():
        count = seen.get(handle, 0)
        seen[handle] = count + 1
        keys.append((handle, count))
    return keys


def _matched_rows(
    sampling_handles: npt.NDArray[np.int64], mask_handles: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """(logits rows, mask rows) that go together, in logits-row order. One broadcast compare
    when every handle is there once (no drafts); by occurrence when drafts repeat handles."""
    if len(np.unique(sampling_handles)) == len(sampling_handles) and len(
        np.unique(mask_handles)
    ) == len(mask_handles):
        logit_rows, mask_rows = np.nonzero(sampling_handles[:, None] == mask_handles[None, :])
        return logit_rows, mask_rows
    position = dict(zip(_occurrences(sampling_handles), range(len(sampling_handles)), strict=True))
    pairs = sorted(
        (position[key], row)
        for row, key in enumerate(_occurrences(mask_handles))
        if key in position
    )
    empty = np.zeros(0, dtype=np.int64)
    if not pairs:
        return empty, empty
    return np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])


def apply_grammar_bitmask(
    logits: torch.Tensor,
    sampling_handles: npt.NDArray[np.int64],
    grammar: GrammarBitmask,
    kernels: CpuKernels | None = None,
) -> None:
    """Set to -inf, in `logits` [N, V] (row i samples for sampling_handles[i]), every token
    the request's mask disallows. A request verifying drafts has several rows, one per position;
    its k-th mask row goes to its k-th logits row (positions without a mask row come after a
    draft the grammar refused, which the mask before rejects). Requests without a mask row are
    left alone; a mask row of a request that does not sample here is ignored (it finished or
    was refused meanwhile). With the CPU `kernels` (fp32 CPU logits), sampling_ops.cpp writes -inf over
    the refused logits only; elsewhere, vectorised: bits unpacked by np.unpackbits, one
    elementwise minimum against a ±inf ceiling."""
    vocab_size = logits.shape[1]
    num_words = grammar.bitmask.shape[1]
    if num_words != (vocab_size + 31) // 32:
        raise MalformedStep(
            f"grammar_bitmask rows have {num_words} words; the vocabulary of {vocab_size} "
            f"tokens needs {(vocab_size + 31) // 32}"
        )
    logit_rows, mask_rows = _matched_rows(sampling_handles, grammar.req_handles)
    if grammar.all_allowed is not None:  # rows that change nothing
        needed = ~grammar.all_allowed[mask_rows]
        logit_rows, mask_rows = logit_rows[needed], mask_rows[needed]
    if not len(logit_rows):
        return
    if kernels is not None and logits.dtype == torch.float32 and logits.stride(1) == 1:
        # writable for torch: copies only a read-only (dense wire form) mask
        bitmask = torch.from_numpy(np.require(grammar.bitmask, np.int32, ["C", "W"]))
        kernels.apply_token_bitmask_(
            logits,
            bitmask,
            torch.from_numpy(np.ascontiguousarray(logit_rows, np.int64)),
            torch.from_numpy(np.ascontiguousarray(mask_rows, np.int64)),
        )
        return
    words = grammar.bitmask[mask_rows].astype("<i4", copy=False)  # bit 0 of word 0 first
    allowed = np.unpackbits(words.view(np.uint8), axis=1, count=vocab_size, bitorder="little")
    # min(logit, +inf) keeps a logit, min(logit, -inf) removes it: branch-free, unlike a
    # masked_fill over a scattered mask (several times slower on CPU for string states).
    ceiling = np.take(_CEILINGS, allowed)
    every_row = len(logit_rows) == logits.shape[0]  # (nonzero: then the rows are in order)
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        # numpy on the same memory: one thread, no hand-off to torch's intra-op pool (which
        # costs more than this op on a busy machine)
        values = logits.numpy()
        if every_row:
            np.minimum(values, ceiling, out=values)
        else:
            values[logit_rows] = np.minimum(values[logit_rows], ceiling)
        return
    bounds = torch.from_numpy(ceiling).to(logits.device, logits.dtype)
    if every_row:
        torch.minimum(logits, bounds, out=logits)
        return
    rows = torch.from_numpy(logit_rows).to(logits.device)
    logits[rows] = torch.minimum(logits[rows], bounds)

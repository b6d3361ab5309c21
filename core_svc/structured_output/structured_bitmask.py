"""A step's grammar bitmask on the wire: dense, or sparse when that is smaller.

At batch 32 a dense mask is 128 KB (32k vocabulary) to 196 KB (49k) per step, and it travels on
the critical path of every constrained step (under async scheduling in a message of its own,
while the rank runs the forward). Most words of a real mask are 0 (between keys, in numbers and
enums a few tokens are allowed) or -1 (inside an unbounded string almost every token is), so
each row is sent as its majority word plus the words that differ from it (~6 KB for the
benchmark's batch 32 instead of 128 KB). A row that allows every token is a default of -1 with
nothing listed: the rank leaves its logits alone. Small masks (batch 1: 4 KB) stay dense, as
encoding them would cost more than it saves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

SPARSE_MIN_DENSE_BYTES = 16 * 1024
"""Masks smaller than this stay dense (a few KB cost less to copy than to encode)."""


@dataclass(frozen=True, slots=True)
class SparseBitmask:
    """The rows of a packed bitmask [rows, num_words] as default words plus listed exceptions
    (the wire form of worker.v1.SparseGrammarBitmask)."""

    num_words: int
    row_defaults: bytes
    """One byte per row: 1 when its unlisted words are -1 (allow), 0 when they are 0 (refuse)."""
    num_listed_words: list[int]
    word_indices: bytes
    """Little-endian uint32 word index within the row, row after row."""
    words: bytes
    """Little-endian int32 words, in word_indices' order."""


def sparse_bitmask(
    words: npt.NDArray[np.int32], min_dense_bytes: int = SPARSE_MIN_DENSE_BYTES
) -> SparseBitmask | None:
    """`words` [rows, num_words] in the sparse form, or None when the dense one is no larger
    (or below `min_dense_bytes`). A few whole-array passes (flatnonzero of a boolean array is
    the fast one), the rest on the listed words only: ~30 us at batch 32."""
    num_rows, num_words = words.shape
    if words.nbytes < min_dense_bytes or not num_rows:
        return None
    num_ones = np.bincount(np.flatnonzero(words == -1) // num_words, minlength=num_rows)
    allow_by_default = 2 * num_ones > num_words  # mostly -1: list the words that are not
    if allow_by_default.any():
        defaults = np.where(allow_by_default, np.int32(-1), np.int32(0))
        listed = np.flatnonzero(words != defaults[:, None])
    else:
        listed = np.flatnonzero(words != 0)
    if 8 * len(listed) + 5 * num_rows >= words.nbytes:
        return None
    rows = listed // num_words
    return SparseBitmask(
        num_words=num_words,
        row_defaults=allow_by_default.astype(np.uint8).tobytes(),
        num_listed_words=np.bincount(rows, minlength=num_rows).tolist(),
        word_indices=(listed - rows * num_words).astype("<u4").tobytes(),
        words=words.reshape(-1)[listed].astype("<i4", copy=False).tobytes(),
    )

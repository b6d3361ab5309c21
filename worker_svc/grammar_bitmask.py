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

from worker_svc.scheduler_output import GrammarBitmask
from worker_svc.step_checks import MalformedStep

GrammarSource = Callable[[], GrammarBitmask | None]
"""Waits for the deferred bitmask of the running step (has_pending_grammar)."""

_BIT_VALUES = torch.arange(32, dtype=torch.int32)


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


def apply_grammar_bitmask(
    logits: torch.Tensor, sampling_handles: npt.NDArray[np.int64], grammar: GrammarBitmask
) -> None:
    """Set to -inf, in `logits` [N, V] (row i samples for sampling_handles[i]), every token
    the request's mask disallows. A request verifying drafts has several rows, one per position;
    its k-th mask row goes to its k-th logits row (positions without a mask row come after a
    draft the grammar refused, which the mask before rejects). Requests without a mask row are
    left alone; a mask row of a request that does not sample here is ignored (it finished or
    was refused meanwhile)."""
    vocab_size = logits.shape[1]
    num_words = grammar.bitmask.shape[1]
    if num_words != (vocab_size + 31) // 32:
        raise MalformedStep(
            f"grammar_bitmask rows have {num_words} words; the vocabulary of {vocab_size} "
            f"tokens needs {(vocab_size + 31) // 32}"
        )
    position = dict(zip(_occurrences(sampling_handles), range(len(sampling_handles)), strict=True))
    pairs = [
        (position[key], row)
        for row, key in enumerate(_occurrences(grammar.req_handles))
        if key in position
    ]
    if not pairs:
        return
    logit_rows = torch.tensor([p[0] for p in pairs], device=logits.device)
    words = torch.from_numpy(grammar.bitmask[[p[1] for p in pairs]]).to(logits.device)
    bits = (words.unsqueeze(-1) >> _BIT_VALUES.to(logits.device)) & 1
    disallowed = bits.reshape(len(pairs), -1)[:, :vocab_size] == 0
    rows = logits[logit_rows]
    logits[logit_rows] = rows.masked_fill_(disallowed, float("-inf"))

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


def apply_grammar_bitmask(
    logits: torch.Tensor, sampling_handles: npt.NDArray[np.int64], grammar: GrammarBitmask
) -> None:
    """Set to -inf, in `logits` [N, V] (row i samples for sampling_handles[i]), every token
    the request's mask disallows. Requests without a mask row are left alone; a mask row of a
    request that does not sample here is ignored (it finished or was refused meanwhile)."""
    vocab_size = logits.shape[1]
    num_words = grammar.bitmask.shape[1]
    if num_words != (vocab_size + 31) // 32:
        raise MalformedStep(
            f"grammar_bitmask rows have {num_words} words; the vocabulary of {vocab_size} "
            f"tokens needs {(vocab_size + 31) // 32}"
        )
    position = {handle: i for i, handle in enumerate(sampling_handles.tolist())}
    pairs = [
        (position[handle], row)
        for row, handle in enumerate(grammar.req_handles.tolist())
        if handle in position
    ]
    if not pairs:
        return
    logit_rows = torch.tensor([p[0] for p in pairs], device=logits.device)
    words = torch.from_numpy(grammar.bitmask[[p[1] for p in pairs]]).to(logits.device)
    bits = (words.unsqueeze(-1) >> _BIT_VALUES.to(logits.device)) & 1
    disallowed = bits.reshape(len(pairs), -1)[:, :vocab_size] == 0
    rows = logits[logit_rows]
    logits[logit_rows] = rows.masked_fill_(disallowed, float("-inf"))

"""A rank's grammar mask application against a bit-by-bit reference: the mask's rows go to the
logit rows of their requests (in any order, some requests unconstrained, rows of requests not
sampling here ignored), disallowed tokens become -inf and allowed ones keep their logit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker_svc.grammar_bitmask import apply_grammar_bitmask, grammar_bitmask_from_bytes
from worker_svc.step_checks import MalformedStep


def _reference(
    logits: torch.Tensor, handles: np.ndarray, mask_handles: list[int], words: np.ndarray
) -> torch.Tensor:
    expected = logits.clone()
    vocab_size = logits.shape[1]
    for row, handle in enumerate(mask_handles):
        if handle not in handles.tolist():
            continue
        i = handles.tolist().index(handle)
        for token in range(vocab_size):
            if not (int(words[row, token // 32]) >> (token % 32)) & 1:
                expected[i, token] = float("-inf")
    return expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_masked", [5, 3])
def test_masks_follow_their_requests(dtype: torch.dtype, num_masked: int) -> None:
    rng = np.random.default_rng(num_masked)
    vocab_size = 100  # not a multiple of 32: the last word's high bits are padding
    handles = np.array([40, 11, 7, 93, 5], np.int64)
    mask_handles = [int(h) for h in rng.permutation(handles)[:num_masked]] + [77]  # 77: gone
    words = rng.integers(-(2**31), 2**31, (len(mask_handles), 4), dtype=np.int64)
    words = words.astype(np.int32)
    words[0] = 0  # a row that allows nothing but padding
    grammar = grammar_bitmask_from_bytes(mask_handles, words.astype("<i4").tobytes())
    assert grammar is not None
    logits = torch.randn(len(handles), vocab_size).to(dtype)
    expected = _reference(logits, handles, mask_handles, words)
    apply_grammar_bitmask(logits, handles, grammar)
    assert torch.equal(logits, expected)


def test_a_mask_of_the_wrong_width_is_refused() -> None:
    grammar = grammar_bitmask_from_bytes([1], np.zeros(3, "<i4").tobytes())
    assert grammar is not None
    with pytest.raises(MalformedStep, match="words"):
        apply_grammar_bitmask(torch.zeros(1, 100), np.array([1], np.int64), grammar)

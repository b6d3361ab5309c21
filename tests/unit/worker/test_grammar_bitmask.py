"""A rank's grammar mask application against a bit-by-bit reference: the mask's rows go to the
logit rows of their requests (in any order, some requests unconstrained, rows of requests not
sampling here ignored), disallowed tokens become -inf and allowed ones keep their logit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker_svc.kernels.cpu_kernels import CpuKernels
from worker_svc.sample.grammar_bitmask import apply_grammar_bitmask, grammar_bitmask_from_bytes
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
@pytest.mark.parametrize(("num_masked", "vocab_size"), [(5, 100), (3, 100), (4, 96)])
def test_masks_follow_their_requests(
    dtype: torch.dtype, num_masked: int, vocab_size: int, kernels: CpuKernels | None
) -> None:
    """vocab_size 100 is not a multiple of 32: the last word's high bits are padding."""
    rng = np.random.default_rng(num_masked)
    handles = np.array([40, 11, 7, 93, 5], np.int64)
    mask_handles = [int(h) for h in rng.permutation(handles)[:num_masked]] + [77]  # 77: gone
    words = rng.integers(
        -(2**31), 2**31, (len(mask_handles), (vocab_size + 31) // 32), dtype=np.int64
    )
    words = words.astype(np.int32)
    words[0] = 0  # a row that allows nothing but padding
    words[1, 1] = -1  # a word that allows all its 32 tokens
    grammar = grammar_bitmask_from_bytes(mask_handles, words.astype("<i4").tobytes())
    assert grammar is not None
    logits = torch.randn(len(handles), vocab_size).to(dtype)
    expected = _reference(logits, handles, mask_handles, words)
    apply_grammar_bitmask(logits, handles, grammar, kernels)
    assert torch.equal(logits, expected)


def test_a_mask_of_the_wrong_width_is_refused(kernels: CpuKernels | None) -> None:
    grammar = grammar_bitmask_from_bytes([1], np.zeros(3, "<i4").tobytes())
    assert grammar is not None
    with pytest.raises(MalformedStep, match="words"):
        apply_grammar_bitmask(torch.zeros(1, 100), np.array([1], np.int64), grammar, kernels)


def test_the_kernel_refuses_rows_out_of_range_and_bad_tensors() -> None:
    kernels = CpuKernels.load()
    assert kernels is not None
    logits, bitmask = torch.zeros(2, 64), torch.zeros(3, 2, dtype=torch.int32)
    rows = torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="logit_rows"):
        kernels.apply_token_bitmask_(logits, bitmask, torch.tensor([0, 2]), rows)
    with pytest.raises(RuntimeError, match="mask_rows"):
        kernels.apply_token_bitmask_(logits, bitmask, rows, torch.tensor([-1, 0]))
    with pytest.raises(RuntimeError, match="words"):
        kernels.apply_token_bitmask_(torch.zeros(2, 100), bitmask, rows, rows)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.apply_token_bitmask_(logits.half(), bitmask, rows, rows)
    assert torch.equal(logits, torch.zeros(2, 64))  # nothing written before the checks passed

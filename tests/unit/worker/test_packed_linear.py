"""Packed (oneDNN) linears run with bucketed row counts, so a mixed load's varying step sizes
reuse a few cached primitives instead of growing oneDNN's shape-keyed caches without end (the
soak's worker memory growth, docs/reliability.md)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker_svc.layers import linear as linear_module
from worker_svc.layers.linear import linear, pack_weight, padded_rows

MAX_STEP_TOKENS = 2048


def test_padded_rows_cover_every_step_size_with_few_buckets() -> None:
    sizes = [padded_rows(n) for n in range(1, MAX_STEP_TOKENS + 1)]
    assert all(size >= n for n, size in enumerate(sizes, start=1))
    assert all((size - n) * 8 < n for n, size in enumerate(sizes, start=1))  # < 12.5% padding
    assert len(set(sizes)) <= 80
    assert padded_rows(1) == 1 and padded_rows(MAX_STEP_TOKENS) == MAX_STEP_TOKENS


@pytest.mark.skipif(pack_weight(torch.ones(2, 2)) is None, reason="no oneDNN packing here")
def test_packed_matmuls_see_only_bucketed_row_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: set[int] = set()
    run_packed = linear_module.packed_linear

    def recording(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        seen.add(x.shape[0])
        return run_packed(x, packed, bias)

    monkeypatch.setattr(linear_module, "packed_linear", recording)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(8, 16, generator=generator)
    bias = torch.randn(8, generator=generator)
    packed = pack_weight(weight)
    for num_tokens in range(1, MAX_STEP_TOKENS + 1, 7):
        x = torch.randn(num_tokens, 16, generator=generator)
        out = linear(x, weight, packed, bias)
        torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4)
    assert seen <= {padded_rows(n) for n in range(1, MAX_STEP_TOKENS + 1)}
    assert len(seen) <= 80


@pytest.mark.skipif(pack_weight(torch.ones(2, 2)) is None, reason="no oneDNN packing here")
def test_packed_linear_keeps_leading_dimensions() -> None:
    weight = torch.randn(8, 16)
    x = torch.randn(2, 5, 16)
    out = linear(x, weight, pack_weight(weight), None)
    assert out.shape == (2, 5, 8)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-4, atol=1e-4)

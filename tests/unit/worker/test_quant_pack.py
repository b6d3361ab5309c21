"""GroupQuantized's checks: a loader's weight is scanned once for codes and groups out of range;
its slices, reorderings and joins (`derived`) keep the parent's codes, so only their shapes are
checked again."""

from __future__ import annotations

import pytest
import torch

from worker_svc.layers.quant_pack import GroupQuantized, derived
from worker_svc.layers.quant_source import merge_rows


def four_bit(num_rows: int = 4, num_cols: int = 64, group_size: int = 32) -> GroupQuantized:
    values = torch.randint(0, 16, (num_rows, num_cols), dtype=torch.uint8)
    scales = torch.rand(num_rows, num_cols // group_size)
    return GroupQuantized(values, scales, -8 * scales, 4, group_size)


def test_a_loaders_weight_is_scanned_for_codes_and_groups_out_of_range() -> None:
    q = four_bit()
    bad = q.values.clone()
    bad[3, 63] = 16
    with pytest.raises(ValueError, match="4-bit values must lie in 0..15"):
        GroupQuantized(bad, q.scales, q.offsets, 4, 32)
    g_idx = torch.tensor([0] * 63 + [2])
    with pytest.raises(ValueError, match="g_idx must give each of the 64 columns a group < 2"):
        GroupQuantized(q.values, q.scales, q.offsets, 4, 32, g_idx)


def test_slices_reorderings_and_joins_are_the_parents_values() -> None:
    q = four_bit()
    weight = q.dequantize()
    order = torch.tensor([2, 0, 3, 1])
    assert torch.equal(q.rows(order).dequantize(), weight[order])
    assert torch.equal(q.rows(slice(1, 3)).cols(slice(32, 64)).dequantize(), weight[1:3, 32:])
    joined = merge_rows([q.rows(slice(0, 1)), q.rows(slice(1, 4))])
    assert torch.equal(joined.dequantize(), weight)


def test_derived_weights_check_shapes_but_not_the_parents_codes_again() -> None:
    q = four_bit()
    with pytest.raises(ValueError, match=r"scales must be \[4, groups\]"):
        derived(q, scales=q.scales[:2])
    with pytest.raises(ValueError, match="quantization group of 32"):
        q.cols(slice(0, 16))
    q.values[0, 0] = 16  # written after the check: a slice is not scanned again ...
    assert int(q.rows(slice(0, 1)).values.max()) == 16
    with pytest.raises(ValueError, match="0..15"):  # ... a new weight from those codes is
        GroupQuantized(q.values, q.scales, q.offsets, 4, 32)

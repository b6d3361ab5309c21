"""Quantized checkpoint tensors as the layers read them: a `QuantizedSource` is a
`TensorSource` whose slices also come quantized (`quantized(index)`), so a layer that keeps
the weight quantized takes its tensor-parallel slice without a float copy, and any other
reader (a layer left unquantized) still gets float values.

`QuantizedTensor` is the in-memory one (GGUF blocks converted, online quantization, tests);
a loader whose format slices cheaply on disk may implement the protocol itself. Fused layers
(q/k/v, gate/up) receive one part per checkpoint tensor; `merge_rows` joins them into one
weight, widening where the parts differ (4-bit parts beside 8-bit ones become 8-bit, groups
become the common divisor), which is exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from worker_svc.layers.quant_pack import GroupQuantized, derived
from worker_svc.layers.tensor_source import TensorSource

Index = slice | tuple[slice, ...]


@runtime_checkable
class QuantizedSource(Protocol):
    """A checkpoint tensor [out, in] that reads quantized (and, through `__getitem__`, as
    float32 values)."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: Index) -> torch.Tensor: ...

    def quantized(self, index: Index) -> GroupQuantized:
        """Rows (and columns) `index` of the weight, quantized."""
        ...


def split_index(index: Index) -> tuple[slice, slice]:
    """(rows, cols) of a slice or a (rows, cols) tuple."""
    if isinstance(index, tuple):
        return index[0], index[1] if len(index) > 1 else slice(None)
    return index, slice(None)


class QuantizedTensor:
    """A `QuantizedSource` over a `GroupQuantized` in memory."""

    def __init__(self, weight: GroupQuantized) -> None:
        self.weight = weight

    def get_shape(self) -> list[int]:
        return list(self.weight.shape)

    def quantized(self, index: Index) -> GroupQuantized:
        rows, cols = split_index(index)
        return self.weight.rows(rows).cols(cols)

    def __getitem__(self, index: Index) -> torch.Tensor:
        return self.quantized(index).dequantize()

    def row_range(self, start: int, num_rows: int) -> QuantizedTensor:
        """Rows [start, start + num_rows): a fused checkpoint tensor's part, still quantized."""
        return QuantizedTensor(self.weight.rows(slice(start, start + num_rows)))


class ConvertedTensor:
    """A `QuantizedSource` over one layer's checkpoint tensors in a packed format (AWQ, GPTQ,
    compressed-tensors): read whole and turned into a `GroupQuantized` by `convert` when a
    layer first asks; `shape` is the weight's [out, in]."""

    def __init__(
        self,
        parts: dict[str, TensorSource],
        convert: Callable[[dict[str, torch.Tensor]], GroupQuantized],
        shape: list[int],
    ) -> None:
        self.parts = parts
        self.convert = convert
        self.shape = shape
        self._weight: QuantizedTensor | None = None

    def weight(self) -> QuantizedTensor:
        if self._weight is None:
            tensors = {name: source[:] for name, source in self.parts.items()}
            self._weight = QuantizedTensor(self.convert(tensors))
        return self._weight

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def quantized(self, index: Index) -> GroupQuantized:
        return self.weight().quantized(index)

    def __getitem__(self, index: Index) -> torch.Tensor:
        return self.weight()[index]

    def row_range(self, start: int, num_rows: int) -> QuantizedTensor:
        return self.weight().row_range(start, num_rows)


def widened(q: GroupQuantized, bits: int, group_size: int, with_offsets: bool) -> GroupQuantized:
    """`q` as `bits`-bit values in groups of `group_size` (dividing q's), exactly."""
    values, scales, offsets = q.values, q.scales, q.offsets
    if bits == 8 and q.bits == 4:
        values = values.to(torch.int8)  # 0..15 are int8 values too, same scales and offsets
    if group_size != q.group_size:
        repeat = q.group_size // group_size
        num_groups = -(-q.shape[1] // group_size)
        scales = scales.repeat_interleave(repeat, dim=1)[:, :num_groups]
        if offsets is not None:
            offsets = offsets.repeat_interleave(repeat, dim=1)[:, :num_groups]
    if with_offsets and offsets is None:
        offsets = torch.zeros_like(scales)
    return derived(
        q, values=values, scales=scales, offsets=offsets, bits=bits, group_size=group_size
    )


def merge_rows(parts: list[GroupQuantized]) -> GroupQuantized:
    """The parts stacked by rows (in order) as one weight."""
    if len(parts) == 1:
        return parts[0]
    num_cols = {p.shape[1] for p in parts}
    if len(num_cols) != 1:
        raise ValueError(f"fused quantized parts have different input sizes: {sorted(num_cols)}")
    orders = [p.g_idx for p in parts]
    if any(o is not None for o in orders):
        first = orders[0]
        if first is None or any(o is None or not torch.equal(o, first) for o in orders):
            raise ValueError("fused quantized parts have different act-order groups (g_idx)")
        group_size = parts[0].group_size
    else:
        group_size = math.gcd(*(p.group_size for p in parts))
    bits = max(p.bits for p in parts)
    with_offsets = any(p.offsets is not None for p in parts)
    same = [widened(p, bits, group_size, with_offsets) for p in parts]
    offsets = [p.offsets for p in same]
    return derived(
        same[0],
        values=torch.cat([p.values for p in same]),
        scales=torch.cat([p.scales.float() for p in same]),
        offsets=None
        if not with_offsets
        else torch.cat([o.float() for o in offsets if o is not None]),
    )


def zero_rows(num_rows: int, like: GroupQuantized) -> GroupQuantized:
    """`num_rows` rows of zeros shaped like `like`'s (the padding rows of a vocabulary)."""
    return GroupQuantized(
        like.values.new_zeros(num_rows, like.shape[1]),
        like.scales.new_zeros(num_rows, like.scales.shape[1]),
        None if like.offsets is None else like.offsets.new_zeros(num_rows, like.scales.shape[1]),
        like.bits,
        like.group_size,
        like.g_idx,
    )

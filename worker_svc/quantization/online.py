"""Online quantization (`--quantization int8 | int4 | w8a8`): a float checkpoint's linear weights
quantized when a rank reads its slice, round to nearest (no calibration data).

    int8  W8A16: int8, one scale per output row, symmetric: scale = absmax / 127
    int4  W4A16: 4-bit, groups of 32 columns (llama.cpp's Q4_0/Q4_1 granularity; groups of
          128 cost SmolLM2 +17.8 % mean NLL, docs/benchmarks.md), asymmetric: scale =
          (max - min) / 15 and offset = min per group (both rounded to float16 first, and the
          integers taken against the rounded ones, so the stored weight is exactly what the
          kernel multiplies)
    w8a8  W8A8: the weights as int8; activations quantized per token at run time

The LM head (and the embedding table it is tied to) takes int8 per-row scales in all three
(llama.cpp keeps its output layer at 6 bits or more for the same reason: the logits are the
most sensitive matmul). Quality against bfloat16: benchmarks/quant_quality.py, docs/models.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Self

import torch

from worker_svc.layers.quant_pack import GroupQuantized
from worker_svc.layers.quant_source import Index, split_index
from worker_svc.layers.tensor_source import RowRange, TensorSource
from worker_svc.quantization.config import QuantizationConfig

INT4_GROUP_SIZE = 32


@dataclass(frozen=True, slots=True)
class OnlineScheme:
    """How a float weight is quantized: `bits`, `group_size` (0: one group per row)."""

    bits: int
    group_size: int

    def quantize(self, weight: torch.Tensor) -> GroupQuantized:
        if self.bits == 8:
            return quantize_int8_per_row(weight)
        return quantize_int4_groups(weight, self.group_size)


INT8_PER_ROW = OnlineScheme(8, 0)
INT4_GROUPS = OnlineScheme(4, INT4_GROUP_SIZE)


class OnlineConfig(QuantizationConfig):
    """A float checkpoint's linear layers quantized at load with `scheme` (the LM head int8 per
    row in all of them), weight-only or with `is_w8a8` activations too."""

    scheme: ClassVar[OnlineScheme] = INT8_PER_ROW
    is_w8a8: ClassVar[bool] = False

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        return cls()  # a float checkpoint has no quantization_config


class Int8Config(OnlineConfig):
    """The registry's `int8`: W8A16, one scale per output row."""


class Int4Config(OnlineConfig):
    """The registry's `int4`: W4A16 in groups of 32."""

    scheme = INT4_GROUPS


class W8a8Config(OnlineConfig):
    """The registry's `w8a8`: int8 weights, activations quantized per token at run time."""

    is_w8a8 = True


def _as_float16_where_exact(t: torch.Tensor) -> torch.Tensor:
    """`t` rounded to float16 where float16 holds it (finite), else as it is."""
    rounded = t.half().float()
    return torch.where(torch.isfinite(rounded), rounded, t)


def quantize_int8_per_row(weight: torch.Tensor) -> GroupQuantized:
    """Symmetric int8 with one scale per row: q = round(w / (absmax / 127))."""
    w = weight.float()
    scales = w.abs().amax(dim=1, keepdim=True) / 127.0
    safe = torch.where(scales > 0, scales, 1.0)
    values = torch.clamp(torch.round(w / safe), -127, 127).to(torch.int8)
    return GroupQuantized(values, scales, None, 8, w.shape[1])


def quantize_int4_groups(weight: torch.Tensor, group_size: int) -> GroupQuantized:
    """Asymmetric 4-bit in groups of `group_size` columns (the last one may be shorter)."""
    w = weight.float()
    num_rows, num_cols = w.shape
    num_groups = -(-num_cols // group_size)
    padded = torch.nn.functional.pad(w, (0, num_groups * group_size - num_cols), value=float("nan"))
    groups = padded.view(num_rows, num_groups, group_size)
    low = _as_float16_where_exact(torch.nan_to_num(groups, nan=float("inf")).amin(dim=-1))
    high = torch.nan_to_num(groups, nan=float("-inf")).amax(dim=-1)
    scales = _as_float16_where_exact((high - low) / 15.0)
    safe = torch.where(scales > 0, scales, 1.0)
    q = torch.round((groups - low[..., None]) / safe[..., None])
    values = torch.clamp(torch.nan_to_num(q), 0, 15).to(torch.uint8).view(num_rows, -1)
    return GroupQuantized(values[:, :num_cols], scales, low, 4, group_size)


class OnlineQuantized:
    """A float checkpoint tensor that also reads quantized (a `QuantizedSource`): a slice is
    read and quantized when a layer asks for it. Rows quantize independently, so a rank reads
    only its rows; with one scale per row a column slice (row-parallel) reads whole rows (the
    scale is the whole row's, as at TP=1); int4's groups start at the slice's first column."""

    def __init__(self, source: TensorSource, scheme: OnlineScheme) -> None:
        self.source = source
        self.scheme = scheme

    def get_shape(self) -> list[int]:
        return self.source.get_shape()

    def __getitem__(self, index: Index) -> torch.Tensor:
        return self.source[index]

    def quantized(self, index: Index) -> GroupQuantized:
        rows, cols = split_index(index)
        num_cols = self.get_shape()[1]
        start, stop, _ = cols.indices(num_cols)
        if self.scheme.group_size == 0 or (start, stop) == (0, num_cols):
            return self.scheme.quantize(self.source[rows, :]).cols(cols)
        # a row-parallel rank's columns: its own groups, from its first column (the last one
        # may be shorter), so any tensor_parallel_size that splits the layer works
        return self.scheme.quantize(self.source[rows, start:stop])

    def row_range(self, start: int, num_rows: int) -> OnlineQuantized:
        return OnlineQuantized(RowRange(self.source, start, num_rows), self.scheme)

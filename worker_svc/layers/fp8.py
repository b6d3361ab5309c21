"""FP8 checkpoints (`quantization_config.quant_method: fp8`): float8_e4m3fn weights with scales.

Two scale layouts, as vLLM's Fp8Config reads them: per-tensor (`<name>.weight_scale`, one
float32 per tensor) and block-wise (`<name>.weight_scale_inv`, one float32 per
`weight_block_size` block, e.g. 128 x 128; despite the name it multiplies too). The real weight
is fp8 value x scale. Static activation scales (`input_scale`) are read past: activations are
never quantized with them.

Where FP8 weights are served:
- By default (CPU, and devices without FP8 matmuls) every FP8 tensor is dequantized when a rank
  reads its slice (`Fp8Tensor`), to float32 and then the compute dtype (bfloat16, or float32 with
  --dtype float32): the model then runs as an unquantized one.
- On CUDA devices with FP8 matmuls (compute capability 8.9+), the dense linear layers of the
  decoder keep their slice in FP8 (`Fp8LinearMethod`, chosen per layer when the model is built
  by `Fp8LinearMethods`): per-tensor checkpoints multiply with
  `torch._scaled_mm` (activations quantized per token on the fly, weight scales per output row),
  block-wise ones dequantize one layer's weight at a time inside the matmul. Embeddings, the LM
  head and mixture-of-experts experts are dequantized at load.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.layers.linear import (
    LinearBase,
    LinearMethodBase,
    UnquantizedLinearMethod,
    WeightIndex,
)
from worker_svc.layers.tensor_source import RowRange, TensorSource

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".input_scale")


@dataclass(frozen=True, slots=True)
class Fp8Format:
    """The checkpoint's FP8 layout: block-wise scales of `block_size` (rows, cols), or None for
    per-tensor scales."""

    block_size: tuple[int, int] | None

    @classmethod
    def from_quantization_config(cls, quantization: Any) -> Fp8Format:
        config = dict(quantization if isinstance(quantization, dict) else vars(quantization))
        block = config.get("weight_block_size")
        fmt = config.get("fmt") or "e4m3"
        if fmt not in ("e4m3", "float8_e4m3fn"):
            raise ValueError(f"fp8 format {fmt!r} is not supported; only e4m3 checkpoints are")
        if block is None:
            return cls(None)
        if len(block) != 2 or min(block) < 1:
            raise ValueError(f"fp8 weight_block_size must be two positive sizes, got {block}")
        return cls((int(block[0]), int(block[1])))


def expand_block_scale(
    scale: torch.Tensor, block: tuple[int, int], rows: slice, cols: slice
) -> torch.Tensor:
    """The per-element scale of weight[rows, cols] from block scales [ceil(R/b0), ceil(C/b1)]."""
    b0, b1 = block
    row_blocks = scale[rows.start // b0 : -(-rows.stop // b0)]
    per_row = row_blocks.repeat_interleave(b0, dim=0)[rows.start % b0 :][: rows.stop - rows.start]
    col_blocks = per_row[:, cols.start // b1 : -(-cols.stop // b1)]
    per_col = col_blocks.repeat_interleave(b1, dim=1)[:, cols.start % b1 :]
    return per_col[:, : cols.stop - cols.start]


class Fp8Tensor:
    """A `TensorSource` over an FP8 checkpoint tensor [out, in]: slices read dequantized (float32);
    `raw` and `scale` give the FP8 values and the scales of a slice for layers that keep FP8."""

    def __init__(self, source: TensorSource, scale: torch.Tensor, fmt: Fp8Format) -> None:
        shape = source.get_shape()
        if len(shape) != 2:
            raise ValueError(f"fp8 weights must be 2-D, got shape {shape}")
        self.source = source
        self.scale_tensor = scale.float()
        self.fmt = fmt

    def get_shape(self) -> list[int]:
        return self.source.get_shape()

    def row_range(self, start: int, num_rows: int) -> Fp8Tensor:
        """Rows [start, start + num_rows) (a fused checkpoint tensor's part), still FP8."""
        scale = self.scale_tensor
        if self.fmt.block_size is not None:
            b0 = self.fmt.block_size[0]
            if start % b0:
                raise ValueError(f"fp8 part at row {start} does not start on a {b0}-row block")
            scale = scale[start // b0 : -(-(start + num_rows) // b0)]
        return Fp8Tensor(RowRange(self.source, start, num_rows), scale, self.fmt)

    def bounds(self, index: slice | tuple[slice, ...]) -> tuple[slice, slice]:
        """The (rows, cols) slices `index` reads."""
        rows, cols = (
            (index[0], index[1])
            if isinstance(index, tuple) and len(index) > 1
            else (
                index[0] if isinstance(index, tuple) else index,
                slice(None),
            )
        )
        num_rows, num_cols = self.get_shape()
        r0, r1, rs = rows.indices(num_rows)
        c0, c1, cs = cols.indices(num_cols)
        if rs != 1 or cs != 1:
            raise ValueError("fp8 tensors are read in contiguous slices")
        return slice(r0, r1), slice(c0, c1)

    def raw(self, index: slice | tuple[slice, ...]) -> torch.Tensor:
        rows, cols = self.bounds(index)
        return self.source[rows, cols]

    def scale(self, index: slice | tuple[slice, ...]) -> torch.Tensor:
        """Per-element scales of the slice (a 0-d tensor for per-tensor checkpoints)."""
        if self.fmt.block_size is None:
            return self.scale_tensor.reshape(())
        rows, cols = self.bounds(index)
        return expand_block_scale(self.scale_tensor, self.fmt.block_size, rows, cols)

    def __getitem__(self, index: slice | tuple[slice, ...]) -> torch.Tensor:
        return self.raw(index).float() * self.scale(index)


def fp8_weights(
    weights: Iterator[tuple[str, TensorSource]], scales: dict[str, torch.Tensor], fmt: Fp8Format
) -> Iterator[tuple[str, TensorSource]]:
    """The checkpoint's tensors with every FP8 weight wrapped in an `Fp8Tensor` (its scale taken
    from `scales`) and the scale tensors themselves left out."""
    for name, source in weights:
        if name.endswith(SCALE_SUFFIXES):
            continue
        scale = _scale_of(name, scales, fmt)
        yield name, source if scale is None else Fp8Tensor(source, scale, fmt)


def _scale_of(name: str, scales: dict[str, torch.Tensor], fmt: Fp8Format) -> torch.Tensor | None:
    stem = name.removesuffix(".weight")
    if stem == name:
        return None
    if (block_scale := scales.get(f"{stem}.weight_scale_inv")) is not None:
        if fmt.block_size is None:
            raise ValueError(
                f"fp8 tensor {name} has block scales (weight_scale_inv) but config.json's "
                "quantization_config gives no weight_block_size"
            )
        return block_scale
    return scales.get(f"{stem}.weight_scale")


def can_keep_fp8(device: torch.device, dtype: torch.dtype) -> bool:
    """FP8 weights stay FP8 on CUDA devices with FP8 matmuls (compute capability 8.9+) serving
    in bfloat16 or float16."""
    return (
        device.type == "cuda"
        and dtype in (torch.bfloat16, torch.float16)
        and hasattr(torch, "_scaled_mm")
        and torch.cuda.get_device_capability(device) >= (8, 9)
    )


class Fp8LinearMethod(LinearMethodBase):
    """A linear layer's weight slice kept in FP8: `weight` [out, in] in float8_e4m3fn and
    float32 `weight_scale`, per output row (per-tensor checkpoints: each fused part's scale
    repeated over its rows) or per block."""

    weight_scale: torch.Tensor
    """The layer's `weight_scale` buffer (registered by `create_weights`)."""

    def __init__(self, fmt: Fp8Format) -> None:
        self.fmt = fmt

    @staticmethod
    def fits(shape: tuple[int, int], fmt: Fp8Format, row_starts: list[int]) -> bool:
        """Whether a layer's slice can stay FP8: _scaled_mm wants both dimensions divisible by
        16; block scales need the slice and every part's first row (in the layer and in the
        checkpoint) on block boundaries."""
        if fmt.block_size is None:
            return shape[0] % 16 == 0 and shape[1] % 16 == 0
        b0, b1 = fmt.block_size
        return shape[0] % b0 == 0 and shape[1] % b1 == 0 and all(s % b0 == 0 for s in row_starts)

    def create_weights(self, layer: LinearBase, dtype: torch.dtype, device: torch.device) -> None:
        num_rows, num_cols = layer.output_size_per_rank, layer.input_size_per_rank
        values = torch.empty(num_rows, num_cols, dtype=torch.float8_e4m3fn, device=device)
        layer.weight = nn.Parameter(values, requires_grad=False)
        if self.fmt.block_size is None:
            scale_shape: tuple[int, ...] = (num_rows,)
        else:
            scale_shape = (num_rows // self.fmt.block_size[0], num_cols // self.fmt.block_size[1])
        self.weight_scale = torch.empty(scale_shape, dtype=torch.float32, device=device)
        layer.register_buffer("weight_scale", self.weight_scale)

    def load_weight(
        self, layer: LinearBase, source: TensorSource, index: WeightIndex, rows: slice
    ) -> None:
        """Copy the checkpoint slice `index` (all of this layer's columns) into weight[rows]."""
        if not isinstance(source, Fp8Tensor):
            raise ValueError("a layer kept in FP8 was given a checkpoint tensor that is not FP8")
        layer.weight[rows].copy_(source.raw(index))
        scale = self.weight_scale
        if self.fmt.block_size is None:
            scale[rows].fill_(float(source.scale_tensor.reshape(())))
            return
        b0, b1 = self.fmt.block_size
        src_rows, src_cols = source.bounds(index)
        num_blocks = (rows.stop - rows.start) // b0
        first_row, first_col = src_rows.start // b0, src_cols.start // b1
        blocks = source.scale_tensor[first_row : first_row + num_blocks]
        scale[rows.start // b0 :][:num_blocks].copy_(
            blocks[:, first_col : first_col + scale.shape[1]]
        )

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """FP8 values and scales serve as loaded."""

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T with W = values x scales, in x's dtype (+ bias)."""
        y = self._matmul(layer.weight, self.weight_scale, x)
        return y if bias is None else y.add_(bias)

    def _matmul(self, weight: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.fmt.block_size is not None:
            return F.linear(x, dequantize_blocks(weight, scale, self.fmt.block_size, x.dtype))
        rows = x.reshape(-1, x.shape[-1])
        x_scale = rows.abs().amax(dim=-1, keepdim=True).float().clamp_(min=1e-12) / FP8_MAX
        x_fp8 = (rows / x_scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out = torch._scaled_mm(
            x_fp8,
            weight.t(),
            scale_a=x_scale,
            scale_b=scale.unsqueeze(0),
            out_dtype=torch.bfloat16 if x.dtype == torch.float16 else x.dtype,
        )
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)


def dequantize_blocks(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """An FP8 weight in `dtype`, one block scale per (b0 x b1) tile."""
    b0, b1 = block
    num_rows, num_cols = weight.shape
    tiles = weight.view(num_rows // b0, b0, num_cols // b1, b1).to(torch.float32)
    return (tiles * scale[:, None, :, None]).view(num_rows, num_cols).to(dtype)


@dataclass(frozen=True, slots=True)
class Fp8LinearMethods:
    """An FP8 checkpoint's `LinearMethods`: the layers at `prefixes` (whose checkpoint tensors
    are all FP8) keep FP8 where their slice fits the kernels; every other layer is unquantized
    (its FP8 tensors dequantized as they are read)."""

    fmt: Fp8Format
    prefixes: frozenset[str]

    def method_for(self, layer: LinearBase, prefix: str) -> LinearMethodBase:
        shape = (layer.output_size_per_rank, layer.input_size_per_rank)
        if prefix in self.prefixes and Fp8LinearMethod.fits(shape, self.fmt, layer.row_starts):
            return Fp8LinearMethod(self.fmt)
        return UnquantizedLinearMethod()

    def vocab_method(self, prefix: str) -> LinearMethodBase | None:
        """Embeddings and the LM head are dequantized at load."""
        return None

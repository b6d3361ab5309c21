"""Quantized linear methods (vLLM's quantized `LinearMethodBase`s) on the CPU kernels.

- `WeightOnlyLinearMethod`: int8 or int4 weights with group-wise scales and optional offsets
  (W8A16 / W4A16; per-output-channel scales are one group per row), activations left in the
  compute dtype. The kernel (quant_ops.cpp `quant_linear`) dequantizes inside the dot product;
  for bf16 activations on AVX512_BF16, steps of 32 tokens or more convert each pair of tiles
  once into a cache-resident bf16 panel (quant_dequant.h), from `DEQUANTIZE_ROWS` tokens the
  weight itself rounded to bf16 (the numbers of a bf16 matmul on the dequantized weight, at
  that matmul's speed). Other activations, from `DEQUANTIZE_ROWS` tokens, dequantize the
  weight, transposed, into the compute dtype and take oneDNN's matmul.
- `W8A8LinearMethod`: int8 weights with one scale per output row, activations quantized per
  token on the fly to int8 with vLLM's convention (scale = absmax / 127, round half to even),
  int8 dot products (AVX512_VNNI) and y = (acc x weight scale) x token scale.

A method receives its weight from a `QuantizedSource` (one `GroupQuantized` per fused part and
tensor-parallel slice: the layer picks the rows or columns as for float weights) and packs it
into the kernels' tile layout as soon as every row arrived, so a layer never holds more than
its own float-free parts. The packed tensors are buffers of the layer (counted in its bytes);
an embedding table may share them with a tied LM head (`embed`).

Where the CPU kernels are not loaded (no compiler, SPLITSERVE_CPU_KERNELS=0) the same packed
weights run through torch (dequantized per call: correct, slow). CUDA has no kernels here yet:
the methods refuse a CUDA device.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from worker_svc.kernels.cpu_kernels import CpuKernels, current_cpu_kernels
from worker_svc.layers.linear import (
    LinearBase,
    LinearMethodBase,
    UnquantizedLinearMethod,
    WeightIndex,
)
from worker_svc.layers.quant_pack import (
    GroupQuantized,
    PackedWeight,
    dequantize_packed,
    gather_columns,
    pack,
    unpack_values,
)
from worker_svc.layers.quant_source import merge_rows
from worker_svc.layers.tensor_source import TensorSource

DEQUANTIZE_ROWS = 128
"""From this many tokens a step computes with the weight dequantized (quant_ops.cpp's
SCALED_ROWS: bf16 panels; other dtypes: oneDNN's matmul; measured: docs/benchmarks.md)."""
CUDA_REFUSAL = (
    "int8/int4 quantized linear layers run on the CPU kernels only (no CUDA kernel is wired "
    "yet); serve this model on --device cpu, or unquantized on CUDA"
)


class Layer(Protocol):
    """What holds a quantized weight: a LinearBase, or an embedding table / LM head."""

    output_size_per_rank: int
    input_size_per_rank: int
    weight: torch.Tensor

    def register_buffer(
        self, name: str, tensor: torch.Tensor | None, persistent: bool = True
    ) -> None: ...


class QuantizedMethodBase(LinearMethodBase):
    """Collects a layer's quantized parts and packs them once all rows arrived."""

    def __init__(self, kernels: CpuKernels | None = None) -> None:
        self.kernels = kernels if kernels is not None else current_cpu_kernels()
        self.parts: list[tuple[int, GroupQuantized]] = []
        self.num_rows = 0
        self.packed: PackedWeight | None = None

    def create_weights(self, layer: Layer, dtype: torch.dtype, device: torch.device) -> None:
        if device.type == "cuda":
            raise ValueError(CUDA_REFUSAL)
        # A 0-element placeholder: the loader's completeness check asks for a `weight`.
        placeholder = torch.empty(0, dtype=dtype, device=device)
        layer.weight = nn.Parameter(placeholder, requires_grad=False)

    def load_weight(
        self, layer: LinearBase, source: TensorSource, index: WeightIndex, rows: slice
    ) -> None:
        quantized = getattr(source, "quantized", None)
        if quantized is None:
            raise ValueError(
                f"{type(self).__name__} holds a quantized weight, but the checkpoint tensor is "
                "not quantized"
            )
        self.load_rows(layer, quantized(index), rows.start)

    def load_rows(self, layer: Layer, part: GroupQuantized, first_row: int) -> None:
        """Rows [first_row, first_row + rows of `part`) of the layer's weight."""
        num_rows, num_cols = layer.output_size_per_rank, layer.input_size_per_rank
        if part.shape != (part.shape[0], num_cols) or first_row + part.shape[0] > num_rows:
            raise ValueError(
                f"quantized weight part of shape {part.shape} does not fit rows from "
                f"{first_row} of a [{num_rows}, {num_cols}] layer"
            )
        self.parts.append((first_row, part))
        self.num_rows += part.shape[0]
        if self.num_rows == num_rows:
            ordered = [p for _, p in sorted(self.parts, key=lambda item: item[0])]
            self.parts = []
            self.packed = self.pack(merge_rows(ordered))
            for name in ("qweight", "scales", "offsets", "bounds", "cols"):
                layer.register_buffer(name, getattr(self.packed, name), persistent=False)

    def pack(self, weight: GroupQuantized) -> PackedWeight:
        return pack(weight)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        if self.packed is None:
            raise ValueError(
                f"quantized layer got {self.num_rows} of {layer.output_size_per_rank} rows"
            )

    def require_packed(self) -> PackedWeight:
        if self.packed is None:
            raise RuntimeError("the quantized weight is used before it was loaded")
        return self.packed

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight, float32 (an embedding table's lookup)."""
        p = self.require_packed()
        if p.cols is not None:
            raise ValueError("an embedding table cannot have act-order columns")
        flat = ids.reshape(-1)
        tile, lane = flat // 16, flat % 16
        values = _unpack_rows(p, tile, lane)
        groups = _column_groups(p)
        weight = values * p.scales[tile, :, lane].float()[:, groups]
        if p.offsets is not None:
            weight += p.offsets[tile, :, lane].float()[:, groups]
        return weight[:, : p.in_features].reshape(*ids.shape, p.in_features)


def _column_groups(p: PackedWeight) -> torch.Tensor:
    counts = (p.bounds[1:] - p.bounds[:-1]).long() * 4
    return torch.repeat_interleave(torch.arange(counts.numel()), counts)


def _unpack_rows(p: PackedWeight, tile: torch.Tensor, lane: torch.Tensor) -> torch.Tensor:
    """float32 integers of rows (tile, lane) [n, chunks x 4]."""
    num_tiles, num_chunks = p.qweight.shape[:2]
    if p.bits == 8 and p.int8_order == "quads":
        rows = p.qweight.view(num_tiles, num_chunks, 16, 4)[tile, :, lane]
        return rows.reshape(tile.numel(), -1).float()
    if p.bits == 8:  # [n, chunks, pair, 2]
        rows = p.qweight.view(num_tiles, num_chunks, 2, 16, 2)[tile, :, :, lane]
        return rows.reshape(tile.numel(), -1).float()
    pairs = p.qweight.view(num_tiles, num_chunks, 16, 2)[tile, :, lane]
    return torch.cat([pairs & 15, pairs >> 4], dim=-1).reshape(tile.numel(), -1).float()


class WeightOnlyLinearMethod(QuantizedMethodBase):
    """W8A16 / W4A16 (see the module docstring); the width is the weight's own."""

    def __init__(self, kernels: CpuKernels | None = None) -> None:
        super().__init__(kernels)
        self.has_bf16_panels = self.kernels is not None and "avx512_bf16" in (
            self.kernels.quant_isa()
        )

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        p = self.require_packed()
        rows = x.reshape(-1, x.shape[-1])
        is_panels = self.has_bf16_panels and x.dtype == torch.bfloat16
        if self.kernels is not None and (is_panels or rows.shape[0] < DEQUANTIZE_ROWS):
            out = rows.new_empty(rows.shape[0], p.out_features)
            self.kernels.quant_linear(out, rows, p, bias)
        else:
            weight_t = self.dequantized_t(x.dtype)[:, : p.out_features]
            gathered = gather_columns(rows, p)
            out = gathered @ weight_t if bias is None else torch.addmm(bias, gathered, weight_t)
        return out.reshape(*x.shape[:-1], p.out_features)

    def dequantized_t(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight transposed, in `dtype`: [packed columns, padded output rows]."""
        p = self.require_packed()
        if self.kernels is None:
            return dequantize_packed(p).to(dtype).t()
        return self.kernels.quant_dequantize(p, dtype)


class W8A8LinearMethod(QuantizedMethodBase):
    """W8A8 (see the module docstring): per-channel symmetric int8 weights only."""

    weight_scales: torch.Tensor
    weight_sums: torch.Tensor

    def pack(self, weight: GroupQuantized) -> PackedWeight:
        if weight.bits != 8 or weight.offsets is not None or weight.scales.shape[1] != 1:
            raise ValueError(
                "W8A8 takes int8 weights with one scale per output row and no zero point "
                f"(got {weight.bits} bits, {weight.scales.shape[1]} groups per row, "
                f"{'with' if weight.offsets is not None else 'no'} offsets)"
            )
        packed = pack(weight, int8_order="quads")
        num_padded = packed.qweight.shape[0] * 16
        self.weight_scales = torch.zeros(num_padded)
        self.weight_scales[: weight.shape[0]] = weight.scales[:, 0].float()
        self.weight_sums = torch.zeros(num_padded, dtype=torch.int32)
        self.weight_sums[: weight.shape[0]] = weight.values.sum(dim=1, dtype=torch.int32)
        return packed

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        p = self.require_packed()
        rows = x.reshape(-1, x.shape[-1])
        if self.kernels is not None:
            out = rows.new_empty(rows.shape[0], p.out_features)
            self.kernels.w8a8_linear(out, rows, p, self.weight_scales, self.weight_sums, bias)
        else:
            out = w8a8_reference(rows, p, self.weight_scales, bias)
        return out.reshape(*x.shape[:-1], p.out_features)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-token int8 quantization in torch: (int8 values, float32 scales)."""
    values = x.float()
    scales = values.abs().amax(dim=-1) / 127.0
    inverse = torch.where(scales > 0, 1.0 / scales.double(), 0.0).float()
    quantized = torch.clamp(values * inverse[:, None], -128, 127).round()
    return quantized.to(torch.int8), scales


def w8a8_reference(
    x: torch.Tensor, p: PackedWeight, weight_scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """W8A8 in torch: exact integer dot products (float64), the kernel's epilogue order."""
    values, scales = quantize_rows_reference(x)
    integers = gather_columns(values.double(), p) @ unpack_values(p).double().t()
    out = (integers.float()[:, : p.out_features] * weight_scales[: p.out_features]) * scales[
        :, None
    ]
    return (out if bias is None else out + bias.float()).to(x.dtype)


class QuantizedLinearMethods:
    """A model's `LinearMethods` when some of its weights are quantized: the linear layers at
    `weight_only` prefixes take `WeightOnlyLinearMethod`, those at `w8a8` prefixes
    `W8A8LinearMethod`, the rest stay unquantized; `vocab` names the embedding table and LM
    head prefixes held quantized (weight-only)."""

    def __init__(
        self,
        weight_only: frozenset[str] = frozenset(),
        w8a8: frozenset[str] = frozenset(),
        vocab: frozenset[str] = frozenset(),
    ) -> None:
        self.weight_only = weight_only
        self.w8a8 = w8a8
        self.vocab = vocab

    def method_for(self, layer: LinearBase, prefix: str) -> LinearMethodBase:
        if prefix in self.w8a8:
            return W8A8LinearMethod()
        if prefix in self.weight_only:
            return WeightOnlyLinearMethod()
        return UnquantizedLinearMethod()

    def vocab_method(self, prefix: str) -> LinearMethodBase | None:
        return WeightOnlyLinearMethod() if prefix in self.vocab else None

    def __repr__(self) -> str:
        return (
            f"QuantizedLinearMethods({len(self.weight_only)} weight-only, {len(self.w8a8)} W8A8, "
            f"vocabulary: {sorted(self.vocab)})"
        )

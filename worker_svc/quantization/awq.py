"""AWQ checkpoints in AutoAWQ's GEMM layout (`quantization_config.quant_method: awq`,
`version: gemm`, as vLLM's AWQConfig reads them), served as W4A16 on the int4 kernels.

Each layer stores `qweight` int32 [in, out / 8] (eight 4-bit values a word, columns in AWQ's
interleaved order 0 2 4 6 1 3 5 7), `qzeros` int32 [in / group, out / 8] (same packing) and
`scales` float16 [in / group, out]; w = (q - zero) x scale. A layer becomes `GroupQuantized`
exactly: values q, scale, offset = -zero x scale (a float16 times an integer below 16, exact
in float32). The unpacking is written here: AutoAWQ, whose `unpack_awq` / `reverse_awq_order`
do the same, is archived upstream and imports its whole stack; the tests check this reader
against AutoAWQ's own `dequantize_gemm` on checkpoints packed by its `WQLinear_GEMM`.
Refused in one line: other versions (gemv, exllama, ipex), other bit widths, no zero points.
"""

from __future__ import annotations

from typing import Any

import torch

from worker_svc.layers.quant_pack import GroupQuantized
from worker_svc.layers.quant_source import ConvertedTensor
from worker_svc.layers.tensor_source import TensorSource
from worker_svc.quantization.config import PackedConfig

PARTS = ("qweight", "qzeros", "scales")
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
"""Where each of a word's eight columns is stored (the inverse of AWQ's 0 2 4 6 1 3 5 7)."""


def check_config(quantization: dict[str, Any]) -> int:
    """The group size of a loadable AWQ configuration; ValueError naming what is not."""
    version = str(quantization.get("version", "gemm")).lower()
    bits = quantization.get("bits", quantization.get("w_bit"))
    zero_point = quantization.get("zero_point", True)
    what = None
    if version != "gemm":
        what = f"version {version!r} (the GEMM layout is)"
    elif bits != 4:
        what = f"{bits}-bit weights (4 are)"
    elif not zero_point:
        what = "zero_point false"
    if what is not None:
        raise ValueError(f"quantization method 'awq': {what} is not supported")
    return int(quantization.get("group_size", quantization.get("q_group_size", 128)))


def unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, n / 8] in AWQ's order -> uint8 [rows, n] in column order."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (packed[:, :, None] >> shifts) & 15  # [rows, words, 8], storage order
    in_order = nibbles[:, :, list(AWQ_REVERSE_ORDER)]
    return in_order.reshape(packed.shape[0], -1).to(torch.uint8)


def to_group_quantized(parts: dict[str, torch.Tensor], group_size: int) -> GroupQuantized:
    values = unpack_columns(parts["qweight"]).t().contiguous()  # [out, in]
    zeros = unpack_columns(parts["qzeros"]).t().float()  # [out, groups]
    scales = parts["scales"].t().float()
    return GroupQuantized(values, scales, -zeros * scales, 4, group_size)


def make_source(parts: dict[str, TensorSource], group_size: int) -> ConvertedTensor:
    """A layer's AWQ tensors as one quantized source, shaped [out, in]."""
    num_cols, num_words = parts["qweight"].get_shape()
    return ConvertedTensor(
        parts, lambda t: to_group_quantized(t, group_size), [num_words * 8, num_cols]
    )


class AwqConfig(PackedConfig[int]):
    """vLLM's AWQConfig: the registry's `awq` (and `awq_marlin`)."""

    layer_tensors = PARTS
    marker = "qweight"

    parse_scheme = staticmethod(check_config)

    def make_source(self, layer: dict[str, TensorSource]) -> TensorSource:
        return make_source(layer, self.scheme)

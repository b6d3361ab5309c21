"""MXFP4 (OCP microscaling FP4) weights unpacked to floats, with transformers' own code: the
reader of gpt-oss's MXFP4 experts (quantization/mxfp4.py)."""

from __future__ import annotations

import torch


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """[E, out, in / 32, 16] packed values and [E, out, in / 32] scales -> [E, in, out] in
    `dtype` (the layout of an unquantized gpt-oss checkpoint's expert tensors)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, not {blocks.dtype} / {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)}"
        )
    return convert_moe_packed_tensors(blocks, scales, dtype=dtype)

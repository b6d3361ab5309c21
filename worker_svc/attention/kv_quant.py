"""The KV cache's storage dtype (vLLM's --kv-cache-dtype) and its per-tensor scales.

`auto` stores keys and values in the compute dtype. `fp8` (= `fp8_e4m3`, vLLM's meaning) and
`fp8_e5m2` store one byte per value, so the same memory holds twice the blocks of a bfloat16
cache: a key is stored as key / k_scale rounded to float8_e4m3fn (float8_e5m2) and saturated
to the format's finite range (448; 57344), as vLLM's cache writes do (`__NV_SATFINITE`), and
read back as the stored value x k_scale (values likewise with v_scale). The scales are per
layer and per tensor: 1.0 unless the checkpoint has `k_scale` / `v_scale` tensors for the
layer (compressed-tensors' kv_cache_scheme), as in vLLM's BaseKVCacheMethod.

e4m3 keeps 3 mantissa bits (relative step 2^-3, i.e. rounding error up to 1/16 of a value)
over magnitudes 2^-9..448; e5m2 keeps 2 (up to 1/8) over 2^-16..57344.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_KV_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def kv_cache_torch_dtype(name: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype for a --kv-cache-dtype value ("" or "auto": `compute_dtype`)."""
    if name in ("", "auto"):
        return compute_dtype
    if name not in FP8_KV_DTYPES:
        raise ValueError(
            f"kv_cache_dtype {name!r} is not supported; choose auto, " + ", ".join(FP8_KV_DTYPES)
        )
    return FP8_KV_DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True, slots=True)
class KvScales:
    """One attention layer's per-tensor scales: stored = value / scale."""

    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self) -> None:
        for name, scale in (("k_scale", self.k_scale), ("v_scale", self.v_scale)):
            if not (scale > 0.0 and scale < float("inf")):
                raise ValueError(f"{name} must be a positive finite number, got {scale}")


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in `dtype` (an fp8 dtype), rounded to nearest and saturated to its finite range
    (NaN stays NaN)."""
    limit = torch.finfo(dtype).max
    scaled = x.float() if scale == 1.0 else x.float() / scale
    return scaled.clamp(-limit, limit).to(dtype)


def dequantize(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Stored fp8 values x scale, in the compute `dtype` (fp8 values are exact in bf16/fp16)."""
    values = stored.to(dtype)
    return values if scale == 1.0 else values.mul_(scale)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor's storage as uint8 (index and fill operations on the cache run on it)."""
    return t.view(torch.uint8)

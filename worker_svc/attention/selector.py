"""Which attention backend runs: the names, a lazy table of their classes, the automatic choice.

Each backend module is imported only when its class is asked for (flash-attn and Triton import
heavy packages), and none of them imports this module.
"""

from __future__ import annotations

import pkgutil

import torch

from worker_svc.attention.backend import AttentionBackend
from worker_svc.attention.kv_quant import is_fp8

_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("torch_backend", "TorchAttentionBackend"),
    "triton": ("triton_backend", "TritonAttentionBackend"),
    "flash_attn": ("flash_attn_backend", "FlashAttnBackend"),
    "cpu": ("cpu_backend", "CpuAttentionBackend"),
    "torch_mla": ("mla_backend", "MlaAttentionBackend"),
}
BACKEND_NAMES = tuple(_BACKENDS)
"""In the order "auto" tries them on CUDA (the cpu backend never qualifies there; torch, before
it, always does: torch_mla, for latent caches only, is what the model's needs pick)."""


def backend_class(name: str) -> type[AttentionBackend]:
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose auto or one of {BACKEND_NAMES}"
        )
    module, class_name = _BACKENDS[name]
    cls: type[AttentionBackend] = pkgutil.resolve_name(f"{__package__}.{module}:{class_name}")
    return cls


def available_backends(device: torch.device) -> list[str]:
    """Backends that can run on `device` (block size not yet considered)."""
    return [n for n in BACKEND_NAMES if backend_class(n).unsupported_reason(device, None) is None]


def select_backend(
    requested: str,
    device: torch.device,
    block_size: int | None = None,
    dtype: torch.dtype | None = None,
    kv_cache_dtype: torch.dtype | None = None,
) -> str:
    """Resolve "auto" (CPU: cpu; CUDA: flash_attn, else triton, else torch) or check an
    explicit choice; an fp8 `kv_cache_dtype` needs a backend that stores one (cpu, torch).

    "auto" on CUDA prefers flash_attn, whose paged API needs a block size that is a multiple of
    256; before the block size is known it picks flash_attn provisionally and the KV cache
    initialization resolves again.
    """
    fp8 = kv_cache_dtype is not None and is_fp8(kv_cache_dtype)
    if requested in ("", "auto"):
        if device.type != "cuda":
            return "cpu" if device.type == "cpu" else "torch"
        for name in BACKEND_NAMES:
            cls = backend_class(name)
            if fp8 and not cls.supports_fp8_kv_cache:
                continue
            if cls.unsupported_reason(device, block_size, dtype) is None:
                return name
        return "torch"
    cls = backend_class(requested)
    reason = cls.unsupported_reason(device, block_size, dtype)
    if fp8 and not cls.supports_fp8_kv_cache:
        reason = "it has no fp8 KV cache (--kv-cache-dtype fp8 runs on the cpu and torch backends)"
    if reason is not None:
        raise ValueError(f"attention backend {requested!r} cannot run: {reason}")
    return requested

"""The rank's device: which one a requested name means, its name, and host memory settings."""

from __future__ import annotations

import ctypes
import platform

import torch


def resolve_device(requested: str, rank: int = 0) -> torch.device:
    """ "auto" is CUDA when available (one device per local rank), else CPU."""
    if requested in ("", "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda", rank % torch.cuda.device_count())
        return torch.device("cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {requested!r}; use auto, cpu or cuda")
    return device


def keep_freed_host_memory() -> None:
    """Ask glibc to keep freed memory instead of returning it to the OS at once: per-step
    temporaries of several MB otherwise cost page faults on every allocation (measured: the
    KV gather of a 256-request decode step 4-6x slower)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 1 << 31)  # M_TRIM_THRESHOLD


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"

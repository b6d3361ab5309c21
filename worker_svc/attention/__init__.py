"""Paged attention backends: torch (reference), cpu (faster prefills on CPU), our Triton kernel,
flash-attn's paged API."""

from worker_svc.attention.backend import AttentionBackend, AttentionInputs, AttentionOptions
from worker_svc.attention.selector import (
    BACKEND_NAMES,
    available_backends,
    backend_class,
    select_backend,
)

__all__ = [
    "BACKEND_NAMES",
    "AttentionBackend",
    "AttentionInputs",
    "AttentionOptions",
    "available_backends",
    "backend_class",
    "select_backend",
]

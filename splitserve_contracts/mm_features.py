"""The rules of common.v1.MultiModalFeature that the frontend and the workers share.

The frontend computes a feature's `identifier` from its encoder input; every worker rank checks
the tensor and recomputes the identifier before it uses or caches anything under it, so an
identifier can never name an encoder output it does not stand for (the engine core is a peer,
and a peer's data is untrusted). Torch-free: plain bytes and shapes.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

ITEM_SIZES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}
"""Element types a TensorData may hold, with their sizes in bytes."""

IMAGE = "image"
"""The one modality served so far."""


def feature_identifier(
    dtype: str, shape: Sequence[int], data: bytes, grid_thw: Sequence[int] = ()
) -> str:
    """Hex SHA-256 of the encoder input: dtype, shape, patch grid (when it has one) and bytes
    (the shape and grid too, so two tensors with the same bytes laid out otherwise never share
    an identifier; vLLM's CVE-2025-46722)."""
    h = hashlib.sha256(b"splitserve.mm-feature.v1\0")
    h.update(dtype.encode() + b"\0")
    h.update(",".join(str(int(d)) for d in shape).encode() + b"\0")
    if grid_thw:
        h.update(b"grid:" + ",".join(str(int(d)) for d in grid_thw).encode() + b"\0")
    h.update(data)
    return h.hexdigest()


def grid_problem(grid_thw: Sequence[int], num_patches: int) -> str | None:
    """Why a patch grid (temporal, height, width) does not fit pixel values of `num_patches`
    rows, or None; an empty grid (a fixed-size image) always fits."""
    if not grid_thw:
        return None
    if len(grid_thw) != 3 or any(int(d) <= 0 for d in grid_thw):
        return f"grid_thw {list(grid_thw)} is not three positive numbers"
    t, h, w = (int(d) for d in grid_thw)
    if t * h * w != num_patches:
        return f"grid_thw {list(grid_thw)} makes {t * h * w} patches, the pixel values have {num_patches}"
    return None


def tensor_problem(dtype: str, shape: Sequence[int], data: bytes) -> str | None:
    """Why these are not a valid TensorData, or None."""
    if dtype not in ITEM_SIZES:
        return f"tensor dtype {dtype!r} is not one of {', '.join(sorted(ITEM_SIZES))}"
    if not shape or any(int(d) <= 0 for d in shape):
        return f"tensor shape {list(shape)} is empty or has a zero dimension"
    expected = math.prod(int(d) for d in shape) * ITEM_SIZES[dtype]
    if len(data) != expected:
        return f"tensor of shape {list(shape)} and dtype {dtype} needs {expected} bytes, got {len(data)}"
    return None

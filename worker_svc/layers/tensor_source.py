"""A checkpoint tensor that can be read in part (a tensor-parallel slice) without loading it whole."""

from __future__ import annotations

from typing import Protocol

import torch


class TensorSource(Protocol):
    """What safetensors' `safe_open(...).get_slice(name)` returns; also a wrapped torch.Tensor."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: slice | tuple[slice, ...]) -> torch.Tensor: ...


class InMemoryTensor:
    """A `TensorSource` over a tensor already in memory (tests, tied weights)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: slice | tuple[slice, ...]) -> torch.Tensor:
        return self.tensor[index]


class RowRange:
    """Rows [start, start + num_rows) of another `TensorSource`, read lazily (a fused checkpoint
    tensor split at load, e.g. Phi-3's qkv_proj into q, k and v)."""

    def __init__(self, source: TensorSource, start: int, num_rows: int) -> None:
        self.source = source
        self.start = start
        self.num_rows = num_rows

    def get_shape(self) -> list[int]:
        return [self.num_rows, *self.source.get_shape()[1:]]

    def __getitem__(self, index: slice | tuple[slice, ...]) -> torch.Tensor:
        rows, rest = (index[0], index[1:]) if isinstance(index, tuple) else (index, ())
        first, last, step = rows.indices(self.num_rows)
        if step != 1:
            raise ValueError("RowRange reads contiguous rows only")
        return self.source[(slice(self.start + first, self.start + last), *rest)]


def row_range(source: TensorSource, start: int, num_rows: int) -> TensorSource:
    """Rows [start, start + num_rows) of `source`, in the source's own kind when it has one
    (an FP8 tensor stays FP8, with its scales)."""
    own = getattr(source, "row_range", None)
    return RowRange(source, start, num_rows) if own is None else own(start, num_rows)


def read_rows(source: TensorSource, start: int, size: int) -> torch.Tensor:
    """Rows [start, start + size) of a 1-D or 2-D checkpoint tensor."""
    return source[start : start + size]


def read_cols(source: TensorSource, start: int, size: int) -> torch.Tensor:
    """Columns [start, start + size) of a 2-D checkpoint tensor."""
    return source[:, start : start + size]


def copy_checked(target: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    """Copy `loaded` into `target` (casting dtype), refusing a shape mismatch."""
    if tuple(target.shape) != tuple(loaded.shape):
        raise ValueError(
            f"checkpoint tensor {name} has shape {tuple(loaded.shape)}, "
            f"expected {tuple(target.shape)}"
        )
    target.copy_(loaded)

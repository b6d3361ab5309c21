"""Quantized weights: what checkpoint loaders hand over (`GroupQuantized`) and the tile layout
the CPU kernels read (`PackedWeight`, worker_svc/kernels/quant_tiles.h).

A loader (GGUF, online quantization, and later compressed-tensors, AWQ, GPTQ) only unpacks its
own format into a `GroupQuantized`: one integer per weight and per-group scales and offsets,

    w[n, k] = scales[n, group(k)] * values[n, k] + offsets[n, group(k)]

(`offsets` None: symmetric), where group(k) is k // group_size, or g_idx[k] for act-order
checkpoints. `from_zero_points` and `from_signed` build it from the usual zero-point and
symmetric forms exactly (in float32: a float16/bfloat16 scale times a zero point below 2^8 is
exact). Everything after (TP slicing, packing, the kernels) is shared.

Packing: output rows in tiles of 16, input columns in chunks of 4 (`pack`); int8 chunks come
in two byte orders, "pairs" for the weight-only kernels and "quads" for W8A8's int8 dot
products (quant_tiles.h). The columns are
first put in group order (act-order: sorted by g_idx), and each group's run is padded to a
multiple of 4 with columns that read a zero activation (`cols`); `bounds` gives each group's
first chunk. Scales and offsets are stored float16 where every value is exactly a float16
(GGUF's are), else float32: packing never rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

TILE = 16
CHUNK = 4


@dataclass(frozen=True, slots=True)
class GroupQuantized:
    """A quantized weight [out_features, in_features], unpacked (see the module docstring).

    `values`: int8 for 8 bits (-128..127), uint8 for 4 bits (0..15); `scales`/`offsets`:
    [out_features, num_groups] floats; `group_size`: columns per group (in_features for one
    group per row); `g_idx`: the group of each column (act-order), or None."""

    values: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    bits: int
    group_size: int
    g_idx: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_group_quantized(self)

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.values.shape[0]), int(self.values.shape[1]))

    def column_groups(self) -> torch.Tensor:
        """The group of every column, int64 [in_features]."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.shape[1]) // self.group_size

    def rows(self, index: slice | torch.Tensor) -> GroupQuantized:
        """Rows `index` (a slice, or a tensor of row numbers: a reordering)."""
        return derived(
            self,
            values=self.values[index],
            scales=self.scales[index],
            offsets=None if self.offsets is None else self.offsets[index],
        )

    def cols(self, index: slice) -> GroupQuantized:
        """Columns `index` (a tensor-parallel slice): whole groups only, except with one group
        per row (per-channel scales, shared by every slice) or act-order (all groups kept)."""
        start, stop, step = index.indices(self.shape[1])
        if step != 1:
            raise ValueError("quantized weights are sliced in contiguous column ranges")
        values = self.values[:, start:stop]
        if self.g_idx is not None:
            return derived(self, values=values, g_idx=self.g_idx[start:stop])
        g = self.group_size
        if g >= self.shape[1]:
            return derived(self, values=values, group_size=max(stop - start, 1))
        if start % g or ((stop - start) % g and stop != self.shape[1]):
            raise ValueError(
                f"a slice of columns [{start}, {stop}) splits a quantization group of {g} "
                "columns: choose a tensor_parallel_size that divides the groups"
            )
        groups = slice(start // g, -(-stop // g))
        return derived(
            self,
            values=values,
            scales=self.scales[:, groups],
            offsets=None if self.offsets is None else self.offsets[:, groups],
        )

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out_features, in_features] (the reference every path matches)."""
        groups = self.column_groups()
        weight = self.values.float() * self.scales.float()[:, groups]
        if self.offsets is not None:
            weight += self.offsets.float()[:, groups]
        return weight


def derived(parent: GroupQuantized, **changes: Any) -> GroupQuantized:
    """`replace(parent, **changes)` for changes that keep `parent`'s checked codes and groups (a
    slice, a reordering of rows, a join or widening of checked weights): the shapes are checked
    again, the value and g_idx ranges (a scan of the whole tensor) are not. Everything else builds
    a `GroupQuantized`, which checks them."""
    values = {f.name: getattr(parent, f.name) for f in fields(GroupQuantized)} | changes
    q = object.__new__(GroupQuantized)
    for name, value in values.items():
        object.__setattr__(q, name, value)  # a frozen dataclass, built without __post_init__
    check_group_quantized(q, check_ranges=False)
    return q


def check_group_quantized(q: GroupQuantized, check_ranges: bool = True) -> None:
    """Refuse a malformed weight with a message that names the tensor at fault; `check_ranges`
    False: the codes and g_idx are a checked weight's (`derived`), only the shapes are checked."""
    if q.bits not in (4, 8):
        raise ValueError(f"quantized weights have 4 or 8 bits, not {q.bits}")
    dtype = torch.int8 if q.bits == 8 else torch.uint8
    if q.values.dtype != dtype or q.values.dim() != 2:
        raise ValueError(f"{q.bits}-bit values must be a 2-D {dtype} tensor, got {q.values.dtype}")
    num_rows, num_cols = q.values.shape
    if q.group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {q.group_size}")
    num_groups = q.scales.shape[-1] if q.scales.dim() == 2 else -1
    if q.g_idx is None and num_groups != -(-num_cols // q.group_size):
        num_groups = -1
    if q.scales.dim() != 2 or q.scales.shape[0] != num_rows or num_groups < 1:
        raise ValueError(
            f"scales must be [{num_rows}, groups] for {num_cols} columns in groups of "
            f"{q.group_size}, got {tuple(q.scales.shape)}"
        )
    if not q.scales.is_floating_point():
        raise ValueError(f"scales must be floating point, got {q.scales.dtype}")
    if q.offsets is not None and q.offsets.shape != q.scales.shape:
        raise ValueError(f"offsets must be shaped as scales, got {tuple(q.offsets.shape)}")
    if q.g_idx is not None and (
        q.g_idx.shape != (num_cols,)
        or (check_ranges and (int(q.g_idx.min()) < 0 or int(q.g_idx.max()) >= num_groups))
    ):
        raise ValueError(f"g_idx must give each of the {num_cols} columns a group < {num_groups}")
    if check_ranges and q.bits == 4 and q.values.numel() and int(q.values.max()) > 15:
        raise ValueError("4-bit values must lie in 0..15 (signed ones: use from_signed)")


def from_zero_points(
    values: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
    g_idx: torch.Tensor | None = None,
) -> GroupQuantized:
    """w = scales * (values - zeros), values unsigned (0..2^bits - 1), zeros per group (None:
    the midpoint 2^(bits-1), i.e. symmetric)."""
    scales = scales.float()
    mid = 1 << (bits - 1)
    if bits == 8:  # int8 values q - 128; offset = scale * (128 - zero)
        shifted = (values.to(torch.int16) - mid).to(torch.int8)
        offsets = None if zeros is None else scales * (mid - zeros.float())
        return GroupQuantized(shifted, scales, offsets, 8, group_size, g_idx)
    zero = torch.full_like(scales, mid) if zeros is None else zeros.float()
    return GroupQuantized(values.to(torch.uint8), scales, -scales * zero, 4, group_size, g_idx)


def from_signed(
    values: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int
) -> GroupQuantized:
    """w = scales * values, values signed (int4: -8..7, int8: -128..127)."""
    if bits == 8:
        return GroupQuantized(values.to(torch.int8), scales.float(), None, 8, group_size)
    unsigned = (values.to(torch.int16) + 8).to(torch.uint8)
    return GroupQuantized(unsigned, scales.float(), -8 * scales.float(), 4, group_size)


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A weight in the kernels' tile layout (module docstring; quant_tiles.h)."""

    qweight: torch.Tensor  # [tiles, chunks, 64 (int8) or 32 (int4)], int8 / uint8
    scales: torch.Tensor  # [tiles, groups, 16], float16 or float32
    offsets: torch.Tensor | None
    bounds: torch.Tensor  # int32 [groups + 1], in chunks
    cols: torch.Tensor | None  # int64 [chunks * 4]: input feature of each column (K: zero)
    bits: int
    out_features: int
    in_features: int
    int8_order: str = "pairs"

    @property
    def num_bytes(self) -> int:
        tensors = [self.qweight, self.scales, self.offsets, self.bounds, self.cols]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def column_order(q: GroupQuantized) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cols, run groups, bounds): the packed columns in group order, each group's run padded to
    a multiple of 4 with the zero column (index in_features); the group each run holds; and the
    runs' first chunks."""
    num_cols = q.shape[1]
    groups = q.column_groups()
    order = torch.argsort(groups, stable=True)
    run_groups, counts = torch.unique_consecutive(groups[order], return_counts=True)
    padded = -(-counts // CHUNK) * CHUNK
    cols = torch.full((int(padded.sum()),), num_cols, dtype=torch.int64)
    starts = torch.cumsum(padded, 0) - padded
    taken = torch.repeat_interleave(starts - (torch.cumsum(counts, 0) - counts), counts)
    cols[torch.arange(num_cols) + taken] = order
    bounds = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(padded, 0) // CHUNK])
    return cols, run_groups, bounds.to(torch.int32)


def storage_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float16 when every value is exactly a float16, else float32."""
    for t in tensors:
        if t is not None and not torch.equal(t.float().half().float(), t.float()):
            return torch.float32
    return torch.float16


def _tile_rows(t: torch.Tensor, num_tiles: int) -> torch.Tensor:
    """[rows, ...] padded with zero rows to tiles x 16, viewed [tiles, 16, ...]."""
    pad = num_tiles * TILE - t.shape[0]
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return t.view(num_tiles, TILE, *t.shape[1:])


INT8_ORDERS = ("pairs", "quads")


def pack(q: GroupQuantized, int8_order: str = "pairs") -> PackedWeight:
    """`q` in the tile layout, losslessly."""
    if int8_order not in INT8_ORDERS:
        raise ValueError(f"int8_order must be one of {INT8_ORDERS}, not {int8_order!r}")
    num_rows, num_cols = q.shape
    cols, run_groups, bounds = column_order(q)
    is_identity = torch.equal(cols[:num_cols], torch.arange(num_cols))
    padded = torch.cat([q.values, q.values.new_zeros(num_rows, 1)], dim=1)[:, cols]
    num_tiles, num_chunks = -(-num_rows // TILE), cols.numel() // CHUNK
    tiles = _tile_rows(padded, num_tiles).view(num_tiles, TILE, num_chunks, CHUNK)
    tiles = tiles.permute(0, 2, 1, 3)  # [tiles, chunks, 16, 4]
    if q.bits == 8 and int8_order == "quads":
        qweight = tiles.reshape(num_tiles, num_chunks, TILE * CHUNK).contiguous()
    elif q.bits == 8:  # [tiles, chunks, 2 (column pair), 16, 2]
        pairs = tiles.reshape(num_tiles, num_chunks, TILE, 2, 2).transpose(2, 3)
        qweight = pairs.reshape(num_tiles, num_chunks, TILE * CHUNK).contiguous()
    else:
        qweight = (tiles[..., :2] | (tiles[..., 2:] << 4)).reshape(num_tiles, num_chunks, 32)
        qweight = qweight.contiguous()
    dtype = storage_dtype(q.scales, q.offsets)

    def per_run(t: torch.Tensor) -> torch.Tensor:
        return _tile_rows(t.float()[:, run_groups], num_tiles).transpose(1, 2).to(dtype)

    return PackedWeight(
        qweight=qweight,
        scales=per_run(q.scales).contiguous(),
        offsets=None if q.offsets is None else per_run(q.offsets).contiguous(),
        bounds=bounds,
        cols=None if is_identity else cols,
        bits=q.bits,
        out_features=num_rows,
        in_features=num_cols,
        int8_order=int8_order,
    )


def unpack_values(p: PackedWeight) -> torch.Tensor:
    """The packed integers [tiles x 16, chunks x 4] in packed column order (torch, no kernels)."""
    num_tiles, num_chunks = p.qweight.shape[:2]
    if p.bits == 8 and p.int8_order == "quads":
        tiles = p.qweight.view(num_tiles, num_chunks, TILE, CHUNK).float()
    elif p.bits == 8:
        pairs = p.qweight.view(num_tiles, num_chunks, 2, TILE, 2).transpose(2, 3)
        tiles = pairs.reshape(num_tiles, num_chunks, TILE, CHUNK).float()
    else:
        pairs = p.qweight.view(num_tiles, num_chunks, TILE, 2)
        tiles = torch.cat([pairs & 15, pairs >> 4], dim=-1).float()
    return tiles.permute(0, 2, 1, 3).reshape(num_tiles * TILE, num_chunks * CHUNK)


def dequantize_packed(p: PackedWeight) -> torch.Tensor:
    """float32 [tiles x 16, chunks x 4] = scale x q + offset, in packed column order (torch)."""
    chunk_groups = torch.repeat_interleave(
        torch.arange(p.bounds.numel() - 1), (p.bounds[1:] - p.bounds[:-1]).long()
    )
    column_groups = torch.repeat_interleave(chunk_groups, CHUNK)

    def per_column(t: torch.Tensor) -> torch.Tensor:
        return t.float().transpose(1, 2).reshape(-1, t.shape[1])[:, column_groups]

    weight = unpack_values(p) * per_column(p.scales)
    if p.offsets is not None:
        weight += per_column(p.offsets)
    return weight


def gather_columns(x: torch.Tensor, p: PackedWeight) -> torch.Tensor:
    """x's features in the packed column order (zeros for padding), for a matmul against
    `dequantize_packed(p)`."""
    width = p.qweight.shape[1] * CHUNK
    if p.cols is None:
        return torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    return torch.nn.functional.pad(x, (0, 1))[..., p.cols]

"""Tensor-parallel linear layers.

`ColumnParallelLinear` splits the output features across TP ranks and may fuse several
projections (q/k/v, gate/up) into one matmul: each fused part is split separately, so rank r
holds [q_r; k_r; v_r]. `QKVParallelLinear` splits the KV heads too, or replicates them when
there are fewer KV heads than ranks (as vLLM does). `RowParallelLinear` splits the input features and all-reduces the partial
sums. The pair column -> row needs one all-reduce per block, as in Megatron-LM.

A layer whose checkpoint weight is FP8 may keep its slice in FP8 (`fp8`, set before loading on
devices with FP8 matmuls; layers/fp8.py): it then loads and multiplies through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.distributed import ParallelState
from worker_svc.layers.tensor_source import TensorSource, copy_checked, read_cols, read_rows

if TYPE_CHECKING:
    from worker_svc.layers.fp8 import Fp8Tensor, Fp8Weight


def cpu_packing_available() -> bool:
    """Whether oneDNN can pre-pack linear weights here (a CPU fast path of torch's mkldnn ops)."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of a CPU weight [out, in], or None where packing is unsupported.

    Measured on the 2-core avx512_bf16 host: 2x faster matmuls for 1-32 rows, ~10% for 2048
    rows, in bfloat16 and float32 alike."""
    if weight.device.type != "cpu" or not cpu_packing_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    except RuntimeError:
        return None


BUCKETS_PER_OCTAVE = 8
"""Packed matmuls run with a row count rounded up to one of this many sizes per power of two
(exact up to twice this): 72 sizes for steps of 1..2048 tokens, at most 1/8 padded rows."""


def padded_rows(num_rows: int) -> int:
    """The row count a packed matmul of `num_rows` rows runs with.

    oneDNN builds one primitive per input shape and keeps it in two caches (ideep's
    LRU_CACHE_CAPACITY and oneDNN's ONEDNN_PRIMITIVE_CACHE_CAPACITY, 1024 entries each, both
    holding it); a step's token count changes with every step of a mixed load, so without
    buckets a worker's memory grew by about 2 MB a step (docs/reliability.md, the soak). Eight
    sizes per octave keep the padding under 12.5% (a CPU matmul of a few dozen rows is already
    bound by compute, so coarser buckets cost their padding in full)."""
    if num_rows <= 2 * BUCKETS_PER_OCTAVE:
        return num_rows
    step = 1 << (num_rows.bit_length() - BUCKETS_PER_OCTAVE.bit_length())
    return -(-num_rows // step) * step


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's matmul against a packed weight, `x` [rows, in] as is (no padding)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def linear(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """x W^T + b, through the packed weight when there is one (rows padded to a bucket)."""
    if packed is None:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    num_rows = rows.shape[0]
    num_padded = padded_rows(num_rows)
    if num_padded != num_rows:
        rows = F.pad(rows, (0, 0, 0, num_padded - num_rows))
    out = packed_linear(rows, packed, bias)[:num_rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def _divide(size: int, tp_size: int, what: str) -> int:
    if size % tp_size:
        raise ValueError(f"{what} ({size}) is not divisible by tensor_parallel_size {tp_size}")
    return size // tp_size


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each TP rank holds: num_kv_heads / tp, or one replicated head when tp is
    larger (vLLM's rule; tp must then be a multiple of num_kv_heads)."""
    return max(1, num_kv_heads // tp_size)


def first_kv_head(num_kv_heads: int, tp_size: int, tp_rank: int) -> int:
    """The first KV head of rank `tp_rank`: r * num_kv_heads // tp (so with replication, ranks
    r .. r + tp / num_kv_heads - 1 share one head, as their query heads belong to its group)."""
    return tp_rank * num_kv_heads // tp_size


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b, W split by output rows; fused parts keep their own slices.

    `shards` gives, per part, this rank's (first row, number of rows) in the checkpoint tensor;
    by default each part splits evenly across the TP ranks.

    Invariant: `weight` rows are [part_0 shard, part_1 shard, ...] for this rank.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        *,
        bias: bool,
        parallel: ParallelState,
        dtype: torch.dtype,
        device: torch.device,
        shards: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        super().__init__()
        if shards is None:
            sizes = [_divide(s, parallel.tp_size, "output size") for s in output_sizes]
            shards = [(parallel.tp_rank * size, size) for size in sizes]
        self.part_starts = [start for start, _ in shards]
        self.part_sizes = [size for _, size in shards]
        self.part_offsets = [sum(self.part_sizes[:i]) for i in range(len(self.part_sizes))]
        out = sum(self.part_sizes)
        self.weight = _param((out, input_size), dtype, device)
        self.bias = _param((out,), dtype, device) if bias else None
        self.packed: torch.Tensor | None = None
        self.fp8: Fp8Weight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            y = self.fp8.linear(x)
            return y if self.bias is None else y.add_(self.bias)
        return linear(x, self.weight, self.packed, self.bias)

    def pack(self) -> None:
        """Switch to the packed weight (after loading); the dense copy is released."""
        if self.fp8 is not None:
            return
        self.packed = pack_weight(self.weight)
        if self.packed is not None:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def load(self, param_name: str, source: TensorSource, part: int = 0) -> None:
        """Load this rank's slice of fused part `part` (e.g. 0=q, 1=k, 2=v) of `param_name`."""
        target = self.weight if param_name == "weight" else self.bias
        if target is None:
            raise ValueError(f"checkpoint has a {param_name} this layer does not use")
        size = self.part_sizes[part]
        if self.fp8 is not None and param_name == "weight":
            rows = slice(self.part_starts[part], self.part_starts[part] + size)
            offset = self.part_offsets[part]
            fp8_source: Fp8Tensor = source  # type: ignore[assignment]
            self.fp8.load(fp8_source, (rows, slice(None)), slice(offset, offset + size))
            return
        loaded = read_rows(source, self.part_starts[part], size)
        copy_checked(target.narrow(0, self.part_offsets[part], size), loaded, param_name)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v fused: query heads split across the TP ranks; KV heads split too, or
    replicated when there are fewer of them than ranks (rank r holds KV head
    r * num_kv_heads // tp)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        bias: bool,
        parallel: ParallelState,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        tp, rank = parallel.tp_size, parallel.tp_rank
        q_rows = _divide(num_heads, tp, "attention heads") * head_dim
        kv_rows = kv_heads_per_rank(num_kv_heads, tp) * head_dim
        kv_start = first_kv_head(num_kv_heads, tp, rank) * head_dim
        super().__init__(
            hidden_size,
            [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
            bias=bias,
            parallel=parallel,
            dtype=dtype,
            device=device,
            shards=[(rank * q_rows, q_rows), (kv_start, kv_rows), (kv_start, kv_rows)],
        )


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r W_r^T) + b, W split by input columns; x arrives already split."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool,
        parallel: ParallelState,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.input_size_per_rank = _divide(input_size, parallel.tp_size, "input size")
        self.weight_rows = output_size
        self.weight = _param((output_size, self.input_size_per_rank), dtype, device)
        self.bias = _param((output_size,), dtype, device) if bias else None
        self.packed: torch.Tensor | None = None
        self.fp8: Fp8Weight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            y = self.parallel.all_reduce(self.fp8.linear(x))
            return y if self.bias is None else y.add_(self.bias)
        if self.parallel.tp_size == 1:
            return linear(x, self.weight, self.packed, self.bias)
        y = self.parallel.all_reduce(linear(x, self.weight, self.packed, None))
        return y if self.bias is None else y.add_(self.bias)

    def pack(self) -> None:
        """Switch to the packed weight (after loading); the dense copy is released."""
        if self.fp8 is not None:
            return
        self.packed = pack_weight(self.weight)
        if self.packed is not None:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def load(self, param_name: str, source: TensorSource, part: int = 0) -> None:
        if param_name == "bias":
            if self.bias is None:
                raise ValueError("checkpoint has a bias this layer does not use")
            copy_checked(self.bias, source[:], "bias")
            return
        size = self.input_size_per_rank
        start = self.parallel.tp_rank * size
        if self.fp8 is not None:
            fp8_source: Fp8Tensor = source  # type: ignore[assignment]
            cols = slice(start, start + size)
            self.fp8.load(fp8_source, (slice(None), cols), slice(0, self.weight_rows))
            return
        copy_checked(self.weight, read_cols(source, start, size), param_name)

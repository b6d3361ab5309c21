"""Tensor-parallel linear layers.

`ColumnParallelLinear` splits the output features across TP ranks and may fuse several
projections (q/k/v, gate/up) into one matmul: each fused part is split separately, so rank r
holds [q_r; k_r; v_r]. `QKVParallelLinear` splits the KV heads too, or replicates them when
there are fewer KV heads than ranks (as vLLM does). `RowParallelLinear` splits the input features and all-reduces the partial
sums. The pair column -> row needs one all-reduce per block, as in Megatron-LM.

The layers own the sharding (which rows or columns of a checkpoint tensor a rank holds) and
the all-reduce; how the weight is stored, loaded and multiplied is the layer's
`LinearMethodBase` (vLLM's seam for quantization), chosen when the layer is built by the
model's `LinearMethods` for the layer's module path: `UnquantizedLinearMethod` (the compute
dtype, packed by oneDNN on CPU), layers/fp8.py's `Fp8LinearMethod` (an FP8 checkpoint's
weights kept FP8 on devices with FP8 matmuls), or layers/quantized.py's int8/int4 methods
(W8A16, W4A16, W8A8 on the CPU kernels), which can also hold an embedding table and the LM head
(`LinearMethods.vocab_method`). Other quantization formats add a method and a `LinearMethods`,
not a branch in the layers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Protocol, TypedDict

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.distributed import ParallelState
from worker_svc.layers.tensor_source import TensorSource, copy_checked


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


WeightIndex = slice | tuple[slice, slice]
"""Which part of a checkpoint tensor a rank reads: rows, or (rows, columns)."""


class LinearMethodBase(ABC):
    """How one linear layer stores, loads and multiplies its weight slice (vLLM's
    LinearMethodBase); one instance per layer."""

    @abstractmethod
    def create_weights(self, layer: LinearBase, dtype: torch.dtype, device: torch.device) -> None:
        """Give `layer` its `weight` parameter for the slice [output_size_per_rank,
        input_size_per_rank] (and whatever else the method keeps, e.g. scales)."""

    @abstractmethod
    def load_weight(
        self, layer: LinearBase, source: TensorSource, index: WeightIndex, rows: slice
    ) -> None:
        """Store `source[index]` (a checkpoint slice) as rows `rows` of the layer's weight."""

    @abstractmethod
    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ bias) with this rank's slice W."""

    @abstractmethod
    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Bring the loaded weight into the form `apply` runs fastest with."""

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight as float32 (a method that can hold an embedding table)."""
        raise NotImplementedError(f"{type(self).__name__} cannot hold an embedding table")


class UnquantizedLinearMethod(LinearMethodBase):
    """The weight in the compute dtype; on CPU packed by oneDNN once loaded (`packed`)."""

    def __init__(self) -> None:
        self.packed: torch.Tensor | None = None

    def create_weights(self, layer: LinearBase, dtype: torch.dtype, device: torch.device) -> None:
        layer.weight = _param(
            (layer.output_size_per_rank, layer.input_size_per_rank), dtype, device
        )

    def load_weight(
        self, layer: LinearBase, source: TensorSource, index: WeightIndex, rows: slice
    ) -> None:
        copy_checked(layer.weight[rows], source[index], "weight")

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, layer.weight, self.packed, bias)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Switch to the packed weight where oneDNN packs; the dense copy is released."""
        self.packed = pack_weight(layer.weight)
        if self.packed is not None:
            layer.weight.data = torch.empty(0, dtype=layer.weight.dtype)


class LinearMethods(Protocol):
    """Which method each linear layer of a model takes (vLLM's quantization config)."""

    def method_for(self, layer: LinearBase, prefix: str) -> LinearMethodBase:
        """The method of `layer`, whose module path in the model is `prefix`."""
        ...

    def vocab_method(self, prefix: str) -> LinearMethodBase | None:
        """The method holding the embedding table or LM head at `prefix` ("embed_tokens",
        "lm_head"); None: a dense weight in the compute dtype."""
        ...


class Unquantized:
    """Every layer unquantized."""

    def method_for(self, layer: LinearBase, prefix: str) -> LinearMethodBase:
        return UnquantizedLinearMethod()

    def vocab_method(self, prefix: str) -> LinearMethodBase | None:
        return None


UNQUANTIZED = Unquantized()


class LinearArgs(TypedDict):
    """The keyword arguments every tensor-parallel linear layer takes besides its shape."""

    parallel: ParallelState
    dtype: torch.dtype
    device: torch.device
    methods: LinearMethods
    prefix: str


class LinearBase(nn.Module):
    """A tensor-parallel linear layer: this rank's weight slice [output_size_per_rank,
    input_size_per_rank] (its first rows in the checkpoint at `row_starts`), an optional bias,
    and the method that holds the weight."""

    weight: torch.Tensor

    def __init__(
        self,
        input_size_per_rank: int,
        output_size_per_rank: int,
        row_starts: Sequence[int],
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        methods: LinearMethods,
        prefix: str,
    ) -> None:
        super().__init__()
        self.input_size_per_rank = input_size_per_rank
        self.output_size_per_rank = output_size_per_rank
        self.row_starts = list(row_starts)
        self.bias = _param((output_size_per_rank,), dtype, device) if bias else None
        self.method = methods.method_for(self, prefix)
        self.method.create_weights(self, dtype, device)

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size_per_rank}, out={self.output_size_per_rank}, "
            f"bias={self.bias is not None}, method={type(self.method).__name__}"
        )


def linear_layers(model: nn.Module) -> Iterator[tuple[str, LinearBase]]:
    """Every linear layer of `model` with its module path: what quantization methods hold and
    LoRA adapters will wrap."""
    for path, module in model.named_modules():
        if isinstance(module, LinearBase):
            yield path, module


class ColumnParallelLinear(LinearBase):
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
        methods: LinearMethods = UNQUANTIZED,
        prefix: str = "",
    ) -> None:
        if shards is None:
            sizes = [_divide(s, parallel.tp_size, "output size") for s in output_sizes]
            shards = [(parallel.tp_rank * size, size) for size in sizes]
        self.output_sizes = list(output_sizes)
        """Each fused part's rows in the checkpoint (all ranks together)."""
        self.part_starts = [start for start, _ in shards]
        self.part_sizes = [size for _, size in shards]
        self.part_offsets = [sum(self.part_sizes[:i]) for i in range(len(self.part_sizes))]
        super().__init__(
            input_size,
            sum(self.part_sizes),
            [*self.part_starts, *self.part_offsets],
            bias=bias,
            dtype=dtype,
            device=device,
            methods=methods,
            prefix=prefix,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)

    def load(self, param_name: str, source: TensorSource, part: int = 0) -> None:
        """Load this rank's slice of fused part `part` (e.g. 0=q, 1=k, 2=v) of `param_name`."""
        start, size, offset = self.part_starts[part], self.part_sizes[part], self.part_offsets[part]
        if param_name == "weight":
            self.method.load_weight(
                self, source, slice(start, start + size), slice(offset, offset + size)
            )
            return
        if self.bias is None:
            raise ValueError(f"checkpoint has a {param_name} this layer does not use")
        copy_checked(self.bias.narrow(0, offset, size), source[start : start + size], param_name)


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
        methods: LinearMethods = UNQUANTIZED,
        prefix: str = "",
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
            methods=methods,
            prefix=prefix,
        )


class RowParallelLinear(LinearBase):
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
        methods: LinearMethods = UNQUANTIZED,
        prefix: str = "",
    ) -> None:
        self.parallel = parallel
        size = _divide(input_size, parallel.tp_size, "input size")
        super().__init__(
            size,
            output_size,
            [0],
            bias=bias,
            dtype=dtype,
            device=device,
            methods=methods,
            prefix=prefix,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return self.method.apply(self, x, self.bias)
        y = self.parallel.all_reduce(self.method.apply(self, x, None))
        return y if self.bias is None else y.add_(self.bias)

    def load(self, param_name: str, source: TensorSource, part: int = 0) -> None:
        if param_name == "bias":
            if self.bias is None:
                raise ValueError("checkpoint has a bias this layer does not use")
            copy_checked(self.bias, source[:], "bias")
            return
        size = self.input_size_per_rank
        start = self.parallel.tp_rank * size
        cols = (slice(None), slice(start, start + size))
        self.method.load_weight(self, source, cols, slice(0, self.output_size_per_rank))

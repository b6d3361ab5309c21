"""Mixture-of-experts MLP: a replicated router, top-k routing and tensor-parallel experts.

Sharding: every TP rank holds a slice of every expert's intermediate dimension (vLLM's default
tensor-parallel MoE): gate/up rows [r * I/tp, (r + 1) * I/tp) and the matching down-projection
columns. Each rank routes every token itself (the router is small and replicated, so its logits
never leave the rank), runs its slices of the chosen experts and the block all-reduces once.

The experts run grouped: the (token, choice) pairs are sorted by expert, so each expert's tokens
are one contiguous block of rows, and one grouped matmul per projection covers every expert
(`torch._grouped_mm` on CPU in bfloat16; otherwise, or where its stride rules do not hold, one
matmul per expert that has tokens: in float32 torch's CPU grouped kernel measured slower than
those). No Python loop ever runs per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.distributed import ParallelState
from worker_svc.layers.activation import silu_and_mul
from worker_svc.layers.tensor_source import TensorSource, copy_checked, read_cols, read_rows
from worker_svc.models.model_config import MoeConfig


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert ids) [T, top_k]: softmax over every expert in float32, the top_k
    probabilities, renormalised to sum to 1 when `renormalize` (the same as a softmax over the
    top_k logits)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class MoeRouter(nn.Module):
    """Router logits [T, num_experts] = x W^T, with W [num_experts, hidden] on every rank."""

    def __init__(
        self, hidden_size: int, num_experts: int, *, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def load(self, param_name: str, source: TensorSource, part: int = 0) -> None:
        copy_checked(self.weight, source[:], param_name)


class FusedExperts(nn.Module):
    """This rank's slices of all experts: w13 [E, 2 * I_r, hidden] (gate rows, then up rows) and
    w2 [E, hidden, I_r].

    Checkpoint parts: w13_weight part 2e is expert e's gate, 2e + 1 its up projection;
    w2_weight part e its down projection."""

    def __init__(
        self,
        hidden_size: int,
        moe: MoeConfig,
        *,
        parallel: ParallelState,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        tp = parallel.tp_size
        if moe.intermediate_size % tp:
            raise ValueError(
                f"expert intermediate size ({moe.intermediate_size}) is not divisible by "
                f"tensor_parallel_size {tp}"
            )
        self.num_experts = moe.num_experts
        self.shard_size = moe.intermediate_size // tp
        self.shard_start = parallel.tp_rank * self.shard_size
        shape13 = (moe.num_experts, 2 * self.shard_size, hidden_size)
        shape2 = (moe.num_experts, hidden_size, self.shard_size)
        self.w13_weight = nn.Parameter(torch.empty(shape13, dtype=dtype, device=device), False)
        self.w2_weight = nn.Parameter(torch.empty(shape2, dtype=dtype, device=device), False)

    def num_parts(self, param_name: str) -> int:
        return 2 * self.num_experts if param_name == "w13_weight" else self.num_experts

    def load(self, param_name: str, source: TensorSource, part: int = 0) -> None:
        size = self.shard_size
        if param_name == "w13_weight":
            expert, half = divmod(part, 2)
            target = self.w13_weight[expert].narrow(0, half * size, size)
            copy_checked(target, read_rows(source, self.shard_start, size), param_name)
        elif param_name == "w2_weight":
            loaded = read_cols(source, self.shard_start, size)
            copy_checked(self.w2_weight[part], loaded, param_name)
        else:
            raise ValueError(f"experts have no parameter {param_name!r}")

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum over the chosen experts: [T, hidden] (before all-reduce)."""
        num_tokens, top_k = ids.shape
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        token_index = order // top_k
        ends = torch.cumsum(torch.bincount(flat_ids, minlength=self.num_experts), 0)
        rows = x.index_select(0, token_index)
        hidden = silu_and_mul(grouped_linear(rows, self.w13_weight, ends))
        out_rows = grouped_linear(hidden, self.w2_weight, ends)
        out_rows.mul_(weights.reshape(-1)[order].unsqueeze(-1).to(out_rows.dtype))
        out = torch.zeros(num_tokens, x.shape[-1], dtype=out_rows.dtype, device=x.device)
        return out.index_add_(0, token_index, out_rows)


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """rows[ends[e-1]:ends[e]] @ weight[e]^T for every expert e, as one [M, N] tensor."""
    if can_group(rows, weight):
        return torch._grouped_mm(rows, weight.transpose(1, 2), offs=ends.to(torch.int32))
    out = rows.new_empty(rows.shape[0], weight.shape[1])
    start = 0
    for expert, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = F.linear(rows[start:end], weight[expert])
        start = end
    return out


def can_group(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch's grouped matmul serves here: on CPU in bfloat16, with 16-byte-aligned rows."""
    itemsize = rows.element_size()
    return (
        rows.device.type == "cpu"
        and hasattr(torch, "_grouped_mm")
        and rows.dtype == torch.bfloat16
        and (rows.shape[-1] * itemsize) % 16 == 0
        and (weight.shape[1] * itemsize) % 16 == 0
    )


class SparseMoeBlock(nn.Module):
    """Route, run the chosen experts' slices, all-reduce once."""

    def __init__(
        self,
        hidden_size: int,
        moe: MoeConfig,
        *,
        parallel: ParallelState,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.moe = moe
        self.parallel = parallel
        self.gate = MoeRouter(hidden_size, moe.num_experts, dtype=dtype, device=device)
        self.experts = FusedExperts(hidden_size, moe, parallel=parallel, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.moe.top_k, self.moe.renormalize)
        out = self.experts(x, weights, ids)
        return out if self.parallel.tp_size == 1 else self.parallel.all_reduce(out)

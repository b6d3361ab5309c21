"""Mixture-of-experts MLP: a replicated router, top-k routing and tensor-parallel experts.

Sharding: every TP rank holds a slice of every expert's intermediate dimension (vLLM's default
tensor-parallel MoE): gate/up rows [r * I/tp, (r + 1) * I/tp) and the matching down-projection
columns. With expert parallelism (vLLM's --enable-expert-parallel) the ranks split the experts
instead: rank r holds whole experts, a contiguous run of about E/tp of them (vLLM's linear
placement: the first E % tp ranks take one more), and runs only the (token, choice) pairs routed
to them. Either way each rank routes every token itself (the router is small and replicated, so
its logits never leave the rank) and the block all-reduces its partial sums once.

The experts run grouped: the (token, choice) pairs are sorted by expert, so each expert's tokens
are one contiguous block of rows, and one grouped matmul per projection covers every expert
(`torch._grouped_mm` on CPU in bfloat16; otherwise, or where its stride rules do not hold, one
matmul per expert that has tokens: in float32 torch's CPU grouped kernel measured slower than
those). No Python loop ever runs per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.distributed import ParallelState
from worker_svc.layers.activation import silu_and_mul
from worker_svc.layers.tensor_source import TensorSource, copy_checked, read_cols, read_rows


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """Sparse MLP: each token goes to `top_k` of `num_experts` SiLU-gated experts.

    Routing: softmax over the router logits, the top_k probabilities, renormalised to sum to 1
    when `renormalize` (Mixtral always; Qwen3-MoE when norm_topk_prob). `sparse_layers` marks the
    layers whose MLP is sparse (Qwen3-MoE's mlp_only_layers / decoder_sparse_step)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    sparse_layers: tuple[bool, ...]


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
    """Router logits [T, num_experts] = x W^T (+ b), with W [num_experts, hidden] (and the bias,
    gpt-oss's) on every rank."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(num_experts, dtype=dtype, device=device), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def load(self, param_name: str, source: TensorSource, part: int = 0) -> None:
        target = self.bias if param_name == "bias" else self.weight
        if target is None:
            raise ValueError(f"the router has no {param_name!r}")
        copy_checked(target, source[:], param_name)


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
        self.num_experts = moe.num_experts
        if parallel.enable_expert_parallel:
            self.expert_start, self.num_local_experts = expert_range(
                moe.num_experts, tp, parallel.tp_rank
            )
            self.shard_size, self.shard_start = moe.intermediate_size, 0
        else:
            if moe.intermediate_size % tp:
                raise ValueError(
                    f"expert intermediate size ({moe.intermediate_size}) is not divisible by "
                    f"tensor_parallel_size {tp} (--enable-expert-parallel splits whole experts)"
                )
            self.expert_start, self.num_local_experts = 0, moe.num_experts
            self.shard_size = moe.intermediate_size // tp
            self.shard_start = parallel.tp_rank * self.shard_size
        shape13 = (self.num_local_experts, 2 * self.shard_size, hidden_size)
        shape2 = (self.num_local_experts, hidden_size, self.shard_size)
        self.w13_weight = nn.Parameter(torch.empty(shape13, dtype=dtype, device=device), False)
        self.w2_weight = nn.Parameter(torch.empty(shape2, dtype=dtype, device=device), False)

    def num_parts(self, param_name: str) -> int:
        """Every expert's parts must be in the checkpoint, held here or not."""
        return 2 * self.num_experts if param_name == "w13_weight" else self.num_experts

    def load(self, param_name: str, source: TensorSource, part: int = 0) -> None:
        """Parts of experts another rank holds (expert parallelism) are skipped unread."""
        size = self.shard_size
        if param_name not in ("w13_weight", "w2_weight"):
            raise ValueError(f"experts have no parameter {param_name!r}")
        expert, half = divmod(part, 2) if param_name == "w13_weight" else (part, 0)
        local = expert - self.expert_start
        if not 0 <= local < self.num_local_experts:
            return
        if param_name == "w13_weight":
            target = self.w13_weight[local].narrow(0, half * size, size)
            copy_checked(target, read_rows(source, self.shard_start, size), param_name)
        else:
            loaded = read_cols(source, self.shard_start, size)
            copy_checked(self.w2_weight[local], loaded, param_name)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum over the chosen experts: [T, hidden] (before all-reduce)."""
        pair_weights, pair_tokens, local_ids = self._local_pairs(weights, ids)
        order = torch.argsort(local_ids, stable=True)
        token_index = pair_tokens[order]
        ends = torch.cumsum(torch.bincount(local_ids, minlength=self.num_local_experts), 0)
        rows = x.index_select(0, token_index)
        out_rows = self.expert_mlp(rows, local_ids[order], ends)
        out_rows.mul_(pair_weights[order].unsqueeze(-1).to(out_rows.dtype))
        out = torch.zeros(ids.shape[0], x.shape[-1], dtype=out_rows.dtype, device=x.device)
        return out.index_add_(0, token_index, out_rows)

    def expert_mlp(
        self, rows: torch.Tensor, expert_ids: torch.Tensor, ends: torch.Tensor
    ) -> torch.Tensor:
        """The experts' MLPs over `rows`, sorted by (local) expert: `expert_ids` per row, expert
        e's rows ending at `ends[e]`; SiLU-gated here (gpt-oss's experts have their own)."""
        hidden = silu_and_mul(grouped_linear(rows, self.w13_weight, ends))
        return grouped_linear(hidden, self.w2_weight, ends)

    def _local_pairs(
        self, weights: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The (token, choice) pairs this rank runs: their weights, tokens and local expert ids
        (all pairs, unless expert parallelism leaves some experts to other ranks)."""
        top_k = ids.shape[1]
        local_ids = ids.reshape(-1) - self.expert_start
        pair_weights = weights.reshape(-1)
        if self.num_local_experts == self.num_experts:
            pairs = torch.arange(local_ids.numel(), device=ids.device)
        else:
            is_local = (local_ids >= 0) & (local_ids < self.num_local_experts)
            pairs = is_local.nonzero().squeeze(1)
            local_ids, pair_weights = local_ids[pairs], pair_weights[pairs]
        return pair_weights, pairs // top_k, local_ids


def expert_range(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """(first expert, number of experts) rank `ep_rank` holds: contiguous runs, the first
    num_experts % ep_size ranks one longer (vLLM's linear expert placement)."""
    if num_experts < ep_size:
        raise ValueError(
            f"expert parallelism needs at least one expert per rank: {num_experts} experts, "
            f"tensor_parallel_size {ep_size}"
        )
    base, remainder = divmod(num_experts, ep_size)
    return ep_rank * base + min(ep_rank, remainder), base + (ep_rank < remainder)


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

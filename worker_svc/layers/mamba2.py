"""The Mamba2 mixer (vLLM's MambaMixer2) as a state layer of the engine (layers/state_cache.py).

As transformers' torch path computes it: in_proj -> [z, x, B, C, dt]; a depthwise causal conv1d
over x|B|C and SiLU; dt = softplus(dt + dt_bias) (clamped to time_step_limit where it is not
(0, inf)); A = -exp(A_log); the selective scan h_t = exp(dt A) h_{t-1} + dt B_t x_t,
y_t = C_t h_t + D x_t; the gated RMSNorm norm(y * silu(z)) over groups of
intermediate / n_groups channels; out_proj.

Each request keeps two state tensors in its slot: the conv state (its last k - 1 inputs of x|B|C,
[conv_dim, k - 1]) and the SSM state [heads, head_dim, d_state], both float32 (the conv inputs
are exact in it, the scan accumulates in it). Decode rows (one token each) take one batched
recurrent step; a prefill run takes the chunked SSD scan from its slot's state.

Tensor parallelism: the heads (x, z, dt, A, D, the norm, out_proj's columns) split over the
ranks; B and C split their groups when n_groups % tp == 0, and are replicated when n_groups == 1
(then the gated norm's one group spans the ranks: their sums of squares are all-reduced).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.distributed import ParallelState
from worker_svc.layers.linear import ColumnParallelLinear, LinearArgs, RowParallelLinear
from worker_svc.layers.state_cache import StateMetadata, StateSpec
from worker_svc.layers.tensor_source import TensorSource, copy_checked

STATE_DTYPE = torch.float32
"""The dtype of both state tensors."""

Target = tuple[str, str, int, tuple[int, int] | None]
"""(sub-module, parameter, part, checkpoint rows or None) of a mixer checkpoint tensor."""


@dataclass(frozen=True, slots=True)
class Mamba2Config:
    """One Mamba2 mixer's shape (all ranks together)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    state_size: int
    num_groups: int
    conv_kernel: int
    chunk_size: int
    rms_norm_eps: float
    conv_bias: bool = True
    proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, math.inf)

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.num_groups * self.state_size


class RowShards(nn.Module):
    """Rows of checkpoint tensors held in parts (`shards`: each part's first row and number of
    rows in the checkpoint tensor), a `weight` (and optional `bias`) of rows
    [part_0 rows; part_1 rows; ...], each row reshaped to `row_shape`."""

    def __init__(
        self,
        shards: Sequence[tuple[int, int]],
        row_shape: tuple[int, ...] = (),
        *,
        bias: bool = False,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.part_starts = [start for start, _ in shards]
        self.part_sizes = [size for _, size in shards]
        self.part_offsets = [sum(self.part_sizes[:i]) for i in range(len(shards))]
        rows = sum(self.part_sizes)
        self.weight = nn.Parameter(torch.empty(rows, *row_shape, dtype=dtype, device=device), False)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(rows, dtype=dtype, device=device), False)

    def load(self, param_name: str, source: TensorSource, part: int = 0) -> None:
        target = self.bias if param_name == "bias" else self.weight
        if target is None or param_name not in ("weight", "bias"):
            raise ValueError(f"checkpoint has a {param_name} this layer does not use")
        start, size = self.part_starts[part], self.part_sizes[part]
        rows = target.narrow(0, self.part_offsets[part], size)
        copy_checked(rows, source[start : start + size].reshape(rows.shape), param_name)


def in_proj_sizes(config: Mamba2Config) -> list[int]:
    """The checkpoint in_proj's parts z, x, B, C, dt (their rows, all ranks together)."""
    bc = config.num_groups * config.state_size
    return [config.intermediate_size, config.intermediate_size, bc, bc, config.num_heads]


def mixer_targets(config: Mamba2Config, name: str) -> list[Target]:
    """Where the mixer's checkpoint tensor `name` ("in_proj.weight", "A_log", ...) goes; in_proj
    and conv1d load their parts (z, x, B, C, dt; x, B, C) from their rows."""
    module, _, param = name.rpartition(".")
    if name in ("A_log", "D", "dt_bias"):
        return [(name, "weight", 0, None)]
    if module in ("norm", "out_proj") and param in ("weight", "bias"):
        return [(module, param, 0, None)]
    sizes = {"in_proj": in_proj_sizes(config), "conv1d": in_proj_sizes(config)[1:4]}.get(module)
    if sizes is None or param not in ("weight", "bias"):
        raise ValueError(f"checkpoint tensor {name!r} has no place in a Mamba2 mixer")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(module, param, i, (s, n)) for i, (s, n) in enumerate(zip(starts, sizes, strict=True))]


def with_prefix(args: LinearArgs, name: str) -> LinearArgs:
    """`args` of the linear layer `name` inside the module at `args["prefix"]`."""
    out = args.copy()
    out["prefix"] = f"{args['prefix']}.{name}" if args["prefix"] else name
    return out


def group_range(num_groups: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(first group, number of groups) of B and C on rank `tp_rank`."""
    if num_groups % tp_size == 0:
        size = num_groups // tp_size
        return tp_rank * size, size
    if num_groups == 1:
        return 0, 1
    raise ValueError(
        f"Mamba2 n_groups ({num_groups}) must be 1 or divisible by tensor_parallel_size {tp_size}"
    )


class Mamba2Mixer(nn.Module):
    """This rank's heads of one Mamba2 mixer; called (hidden [T, H], ctx, (conv_state,
    ssm_state)) -> [T, H] (out_proj all-reduced)."""

    def __init__(self, config: Mamba2Config, linear_args: LinearArgs) -> None:
        super().__init__()
        parallel: ParallelState = linear_args["parallel"]
        dtype, device = linear_args["dtype"], linear_args["device"]
        tp, rank = parallel.tp_size, parallel.tp_rank
        if config.num_heads % tp:
            raise ValueError(
                f"Mamba2 heads ({config.num_heads}) are not divisible by tensor_parallel_size {tp}"
            )
        if config.num_heads % config.num_groups:
            raise ValueError(
                f"Mamba2 heads ({config.num_heads}) are not divisible by n_groups "
                f"({config.num_groups})"
            )
        self.config, self.parallel = config, parallel
        self.num_heads = config.num_heads // tp
        group_start, self.num_groups = group_range(config.num_groups, tp, rank)
        self.inner = self.num_heads * config.head_dim
        n = config.state_size
        self.bc_size = self.num_groups * n
        self.conv_dim = self.inner + 2 * self.bc_size
        inner_shard = (rank * self.inner, self.inner)
        bc_shard = (group_start * n, self.bc_size)
        head_shard = (rank * self.num_heads, self.num_heads)
        self.in_proj = ColumnParallelLinear(
            config.hidden_size,
            in_proj_sizes(config),
            bias=config.proj_bias,
            shards=[inner_shard, inner_shard, bc_shard, bc_shard, head_shard],
            **with_prefix(linear_args, "in_proj"),
        )
        conv_shards = [inner_shard, bc_shard, bc_shard]
        kernel, bias = (config.conv_kernel,), config.conv_bias
        self.conv1d = RowShards(conv_shards, kernel, bias=bias, dtype=dtype, device=device)
        self.A_log = RowShards([head_shard], dtype=dtype, device=device)
        self.D = RowShards([head_shard], dtype=dtype, device=device)
        self.dt_bias = RowShards([head_shard], dtype=dtype, device=device)
        self.norm = RowShards([inner_shard], dtype=dtype, device=device)
        self.out_proj = RowParallelLinear(
            config.intermediate_size,
            config.hidden_size,
            bias=config.proj_bias,
            **with_prefix(linear_args, "out_proj"),
        )

    def state_spec(self) -> StateSpec:
        """This rank's state per request: conv (conv_dim, k - 1), SSM (heads, head_dim, d_state)."""
        c = self.config
        shapes = ((self.conv_dim, c.conv_kernel - 1), (self.num_heads, c.head_dim, c.state_size))
        return StateSpec(shapes, STATE_DTYPE)

    def forward(
        self, hidden: torch.Tensor, state: StateMetadata, cache: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        projected = self.in_proj(hidden)
        z, xbc, dt = projected.split([self.inner, self.conv_dim, self.num_heads], dim=-1)
        y = torch.empty_like(z)
        if state.decode_rows:
            rows = state.decode_tokens
            y[rows] = self.decode(
                xbc[rows], dt[rows], state.decode_slots, state.decode_fresh, cache
            )
        for i in state.prefill_rows:
            start, end = state.query_start_loc[i], state.query_start_loc[i + 1]
            if end > start:
                slot, is_fresh = state.slot_list[i], state.context_lens[i] == 0
                y[start:end] = self.prefill(xbc[start:end], dt[start:end], slot, is_fresh, cache)
        return self.out_proj(self.gated_norm(y, z))

    def prefill(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        slot: int,
        fresh: bool,
        cache: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """One request's run of L tokens from its slot's state: y [L, inner]; the slot is
        updated to the state after the run."""
        conv_state, ssm_state = cache
        c, length = self.config, xbc.shape[0]
        weight = self.conv1d.weight
        past = conv_state[slot].to(weight.dtype)
        if fresh:
            past = torch.zeros_like(past)
        inputs = torch.cat([past, xbc.t().to(weight.dtype)], dim=-1)  # [conv_dim, k - 1 + L]
        conv_state[slot] = inputs[:, inputs.shape[1] - (c.conv_kernel - 1) :]
        conv = F.conv1d(inputs[None], weight[:, None], self.conv1d.bias, groups=self.conv_dim)
        x, b, cc = F.silu(conv[0].t()).to(xbc.dtype).split(self.split_sizes(), dim=-1)
        initial = torch.zeros_like(ssm_state[slot]) if fresh else ssm_state[slot]
        y, final = chunk_scan(
            x.reshape(length, self.num_heads, c.head_dim),
            self.discretized_dt(dt),
            self.A(),
            b.reshape(length, self.num_groups, c.state_size),
            cc.reshape(length, self.num_groups, c.state_size),
            c.chunk_size,
            initial.float(),
        )
        ssm_state[slot] = final.to(ssm_state.dtype)
        y = y + self.D.weight.float()[:, None] * x.reshape(y.shape).float()
        return y.reshape(length, self.inner).to(xbc.dtype)

    def decode(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        slots: torch.Tensor,
        fresh: torch.Tensor,
        cache: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """One recurrent step of R requests (one token each): y [R, inner]; their slots
        updated."""
        conv_state, ssm_state = cache
        c, num_rows = self.config, xbc.shape[0]
        keep = (~fresh).to(STATE_DTYPE)
        weight = self.conv1d.weight
        past = conv_state[slots] * keep[:, None, None]
        inputs = torch.cat([past.to(weight.dtype), xbc[:, :, None].to(weight.dtype)], dim=-1)
        conv_state[slots] = inputs[:, :, 1:].to(conv_state.dtype)
        conv = (inputs * weight).sum(-1)
        if self.conv1d.bias is not None:
            conv = conv + self.conv1d.bias
        x, b, cc = F.silu(conv).to(xbc.dtype).split(self.split_sizes(), dim=-1)
        x = x.reshape(num_rows, self.num_heads, c.head_dim).float()
        per_group = self.num_heads // self.num_groups
        b = b.reshape(num_rows, self.num_groups, c.state_size).float()
        cc = cc.reshape(num_rows, self.num_groups, c.state_size).float()
        b = b.repeat_interleave(per_group, dim=1)  # [R, heads, N]
        cc = cc.repeat_interleave(per_group, dim=1)
        delta = self.discretized_dt(dt)  # [R, heads]
        decay = torch.exp(delta * self.A())[:, :, None, None]
        h = ssm_state[slots].float() * keep[:, None, None, None]
        h = h * decay + (delta[:, :, None] * x)[..., None] * b[:, :, None, :]
        ssm_state[slots] = h.to(ssm_state.dtype)
        y = torch.einsum("rhpn,rhn->rhp", h, cc) + self.D.weight.float()[:, None] * x
        return y.reshape(num_rows, self.inner).to(xbc.dtype)

    def split_sizes(self) -> list[int]:
        return [self.inner, self.bc_size, self.bc_size]

    def A(self) -> torch.Tensor:
        return -torch.exp(self.A_log.weight.float())

    def discretized_dt(self, dt: torch.Tensor) -> torch.Tensor:
        """softplus(dt + dt_bias) in float32, clamped to time_step_limit unless it is (0, inf)."""
        delta = F.softplus(dt.float() + self.dt_bias.weight.float())
        low, high = self.config.time_step_limit
        if (low, high) != (0.0, math.inf):
            delta = delta.clamp(low, high)
        return delta

    def gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm(y * silu(z)) over groups of intermediate / n_groups channels, in float32,
        cast back to the input dtype and then scaled by the weight (transformers' order)."""
        gated = y.float() * F.silu(z.float())
        tp, groups = self.parallel.tp_size, self.config.num_groups
        if tp > 1 and groups == 1:  # one group across every rank's channels
            squares = self.parallel.all_reduce(gated.square().sum(-1, keepdim=True))
            normed = gated * torch.rsqrt(squares / (self.inner * tp) + self.config.rms_norm_eps)
        else:
            grouped = gated.reshape(gated.shape[0], -1, self.config.intermediate_size // groups)
            variance = grouped.square().mean(-1, keepdim=True)
            normed = (grouped * torch.rsqrt(variance + self.config.rms_norm_eps)).flatten(1)
        return normed.to(y.dtype) * self.norm.weight


def segment_sum(a: torch.Tensor) -> torch.Tensor:
    """[..., l, s] = sum of a[..., s + 1 : l + 1] for s <= l (0 on the diagonal), -inf above."""
    length = a.shape[-1]
    below = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device), -1)
    sums = torch.cumsum(a[..., None].expand(*a.shape, length).masked_fill(~below, 0), dim=-2)
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device))
    return sums.masked_fill(~causal, -math.inf)


def chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    chunk_size: int,
    initial: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD chunked scan of one sequence (transformers' mamba2_chunk_scan, without D):
    x [L, heads, head_dim], dt [L, heads] (discretized), a [heads] (A), b and c
    [L, groups, d_state], initial [heads, head_dim, d_state] -> (y [L, heads, head_dim],
    final state [heads, head_dim, d_state]), in float32."""
    length, heads, _ = x.shape
    per_group = heads // b.shape[1]
    b = b.float().repeat_interleave(per_group, dim=1)
    c = c.float().repeat_interleave(per_group, dim=1)
    pad = (-length) % chunk_size

    def chunks(t: torch.Tensor) -> torch.Tensor:
        padded = F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))
        return padded.reshape(-1, chunk_size, *t.shape[1:])

    x, b, c = chunks(x.float() * dt[..., None]), chunks(b), chunks(c)
    decays = chunks(a * dt).permute(2, 0, 1)  # [h, chunk, l]
    cumulative = torch.cumsum(decays, dim=-1)
    within = torch.exp(segment_sum(decays)).permute(1, 2, 3, 0)  # [chunk, l, s, h]
    scores = torch.einsum("clhn,cshn->clsh", c, b) * within
    y_diag = torch.einsum("clsh,cshp->clhp", scores, x)
    to_end = torch.exp(cumulative[:, :, -1:] - cumulative).permute(1, 2, 0)  # [chunk, l, h]
    chunk_states = torch.einsum("clhn,clhp->chpn", b * to_end[..., None], x)
    chunk_states = torch.cat([initial[None].float(), chunk_states], dim=0)
    across = torch.exp(segment_sum(F.pad(cumulative[:, :, -1], (1, 0)))).permute(2, 1, 0)
    states = torch.einsum("zch,zhpn->chpn", across, chunk_states)
    states, final = states[:-1], states[-1]
    from_start = torch.exp(cumulative).permute(1, 2, 0)[..., None]  # [chunk, l, h, 1]
    y_off = torch.einsum("clhn,chpn->clhp", c, states) * from_start
    y = (y_diag + y_off).reshape(-1, heads, x.shape[-1])[:length]
    return y, final

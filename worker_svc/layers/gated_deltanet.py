"""The gated DeltaNet layer (Qwen3-Next's linear attention; vLLM's GatedDeltaNetAttention): a
fixed-size state per request instead of KV, read and written through layers/state_cache.py.

Per token: project to q, k, v (the key heads), z (the output gate), b and a (per value head);
a depthwise causal conv1d over the q|k|v channels (its last `conv_kernel - 1` inputs are the
conv state), SiLU; L2-normalised q and k (q also scaled by head_k_dim^-0.5); the gated delta
rule with beta = sigmoid(b) and log-decay g = -exp(A_log) * softplus(a + dt_bias):
    S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  out = S^T q
(S [head_k_dim, head_v_dim] per value head, the recurrent state); a gated RMSNorm per head,
norm(out) * silu(z), and the row-parallel out_proj. Each key head serves num_v_heads /
num_k_heads consecutive value heads.

Checkpoint layout: in_proj_qkvz rows are per key head [q (dk), k (dk), v (r dv), z (r dv)] and
in_proj_ba rows per key head [b (r), a (r)] (r = value heads per key head), so an even row split
gives each TP rank whole key-head groups; the two are fused here as the parts of one column-
parallel matmul. conv1d's channels are q | k | v over all heads; a rank reads its heads' rows of
each. A_log and dt_bias follow the value heads; the norm weight (head_v_dim) is replicated.

State per request (float32 for both, whatever the compute dtype, as transformers keeps the
delta rule's final state): conv [conv_dim / tp, conv_kernel - 1] and recurrent
[num_v_heads / tp, head_k_dim, head_v_dim]. Decode rows (one token) run one batched recurrent
step; each prefill row runs the chunked form (chunks of 64, the UT transform) from its state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.distributed import ParallelState
from worker_svc.layers.linear import (
    UNQUANTIZED,
    ColumnParallelLinear,
    LinearMethods,
    RowParallelLinear,
)
from worker_svc.layers.state_cache import LayerCache, StateMetadata, StateSpec
from worker_svc.layers.tensor_source import TensorSource, copy_checked, read_rows

CHUNK_SIZE = 64
STATE_DTYPE = torch.float32

CHECKPOINT_TENSORS: dict[str, tuple[str, str, int]] = {
    "in_proj_qkvz.weight": ("in_proj", "weight", 0),
    "in_proj_ba.weight": ("in_proj", "weight", 1),
    "conv1d.weight": ("conv1d", "weight", 0),
    "A_log": ("", "A_log", 0),
    "dt_bias": ("", "dt_bias", 0),
    "norm.weight": ("norm", "weight", 0),
    "out_proj.weight": ("out_proj", "weight", 0),
}
"""The checkpoint's tensors of one layer (names under its `linear_attn.`) -> (our sub-module,
"" for the layer itself; parameter; fused part)."""


@dataclass(frozen=True, slots=True)
class DeltaNetShape:
    """The layer's sizes (config.json's linear_* fields) over all TP ranks."""

    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    eps: float

    @property
    def group_rows(self) -> int:
        """in_proj_qkvz rows per key head."""
        ratio = self.num_v_heads // self.num_k_heads
        return 2 * self.head_k_dim + 2 * ratio * self.head_v_dim


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One token per row: q, k [N, H, dk], v [N, H, dv], g, beta [N, H] (float32, q scaled),
    state [N, H, dk, dv]; returns (out [N, H, dv], the new state)."""
    state = state * g.exp()[..., None, None]
    kv_mem = (state * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (state * q.unsqueeze(-1)).sum(dim=-2), state


def chunked_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One request's run: q, k [L, H, dk], v [L, H, dv], g, beta [L, H] (float32, q scaled),
    its initial state [H, dk, dv]; returns (out [L, H, dv], the final state). Within a chunk
    the updates are one triangular solve (the UT transform); the chunks run in sequence."""
    length = q.shape[0]
    pad = (CHUNK_SIZE - length % CHUNK_SIZE) % CHUNK_SIZE
    # [H, chunks, C, d]
    q, k, v = (
        F.pad(x.transpose(0, 1), (0, 0, 0, pad)).unflatten(1, (-1, CHUNK_SIZE)) for x in (q, k, v)
    )
    g, beta = (F.pad(x.transpose(0, 1), (0, pad)).unflatten(1, (-1, CHUNK_SIZE)) for x in (g, beta))
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    upper = torch.ones(CHUNK_SIZE, CHUNK_SIZE, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=-1)
    pairwise = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(
        system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(new_values)
    for i in range(q.shape[1]):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.flatten(1, 2)[:, :length].transpose(0, 1), state


class HasState(Protocol):
    """What the layer reads of its step context (models/decoder.py's StepContext)."""

    @property
    def state(self) -> StateMetadata | None: ...


class GatedDeltaNet(nn.Module):
    """This rank's heads of one gated DeltaNet layer; called (hidden [T, H], ctx, cache)."""

    def __init__(
        self,
        shape: DeltaNetShape,
        *,
        parallel: ParallelState,
        dtype: torch.dtype,
        device: torch.device,
        methods: LinearMethods = UNQUANTIZED,
        prefix: str = "",
    ) -> None:
        super().__init__()
        tp, rank = parallel.tp_size, parallel.tp_rank
        if shape.num_v_heads % shape.num_k_heads:
            raise ValueError(
                f"linear_num_value_heads ({shape.num_v_heads}) is not a multiple of "
                f"linear_num_key_heads ({shape.num_k_heads})"
            )
        if shape.num_k_heads % tp or shape.num_v_heads % tp:
            raise ValueError(
                f"gated DeltaNet heads (linear_num_key_heads {shape.num_k_heads}, "
                f"linear_num_value_heads {shape.num_v_heads}) are not divisible by "
                f"tensor_parallel_size {tp}"
            )
        self.shape = shape
        self.num_k_heads = shape.num_k_heads // tp
        self.num_v_heads = shape.num_v_heads // tp
        dk, dv = shape.head_k_dim, shape.head_v_dim
        self.key_dim, self.value_dim = self.num_k_heads * dk, self.num_v_heads * dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        args = {"parallel": parallel, "dtype": dtype, "device": device, "methods": methods}
        self.in_proj = ColumnParallelLinear(
            shape.hidden_size,
            [shape.num_k_heads * shape.group_rows, 2 * shape.num_v_heads],
            bias=False,
            prefix=f"{prefix}.in_proj" if prefix else "in_proj",
            **args,  # type: ignore[arg-type]
        )
        # conv1d rows: this rank's q, k and v channels, (first row in the checkpoint, rows)
        key_all = shape.num_k_heads * dk
        self.conv_rows = [
            (rank * self.key_dim, self.key_dim),
            (key_all + rank * self.key_dim, self.key_dim),
            (2 * key_all + rank * self.value_dim, self.value_dim),
        ]
        self.conv1d = ConvWeight(self.conv_dim, shape.conv_kernel, self.conv_rows, dtype, device)
        self.v_head_start = rank * self.num_v_heads
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=dtype, device=device), False)
        self.dt_bias = nn.Parameter(
            torch.empty(self.num_v_heads, dtype=dtype, device=device), False
        )
        self.norm = GatedRMSNorm(dv, shape.eps, dtype=dtype, device=device)
        self.out_proj = RowParallelLinear(
            shape.num_v_heads * dv, shape.hidden_size, bias=False, prefix=f"{prefix}.out_proj" if prefix else "out_proj",
            **args,  # type: ignore[arg-type]
        )  # fmt: skip

    def state_spec(self) -> StateSpec:
        """conv [conv_dim, kernel - 1] and recurrent [v_heads, dk, dv] of this rank, float32."""
        shape = self.shape
        return StateSpec(
            (
                (self.conv_dim, shape.conv_kernel - 1),
                (self.num_v_heads, shape.head_k_dim, shape.head_v_dim),
            ),
            STATE_DTYPE,
        )

    def load(self, param_name: str, source: TensorSource, part: int = 0) -> None:
        """A_log and dt_bias: this rank's value heads."""
        if param_name not in ("A_log", "dt_bias"):
            raise ValueError(f"the gated DeltaNet layer has no parameter {param_name!r}")
        target = self.A_log if param_name == "A_log" else self.dt_bias
        copy_checked(target, read_rows(source, self.v_head_start, self.num_v_heads), param_name)

    def split_projection(
        self, proj: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q|k|v [T, conv_dim], z [T, v_heads, dv], b, a [T, v_heads]) from the in_proj rows."""
        tokens, shape = proj.shape[0], self.shape
        dk, dv, ratio = shape.head_k_dim, shape.head_v_dim, shape.num_v_heads // shape.num_k_heads
        qkvz = proj[:, : self.num_k_heads * shape.group_rows].view(tokens, self.num_k_heads, -1)
        q, k, v, z = torch.split(qkvz, [dk, dk, ratio * dv, ratio * dv], dim=-1)
        ba = proj[:, self.num_k_heads * shape.group_rows :].view(tokens, self.num_k_heads, -1)
        b, a = torch.split(ba, [ratio, ratio], dim=-1)
        mixed = torch.cat([x.reshape(tokens, -1) for x in (q, k, v)], dim=-1)
        return (
            mixed,
            z.reshape(tokens, self.num_v_heads, dv),
            b.reshape(tokens, -1),
            a.reshape(tokens, -1),
        )

    def forward(self, hidden: torch.Tensor, ctx: HasState, cache: LayerCache) -> torch.Tensor:
        meta = ctx.state
        if meta is None or not isinstance(cache, tuple):
            raise ValueError("a gated DeltaNet layer needs the step's state metadata and slots")
        conv_state, recurrent_state = cache
        mixed, z, b, a = self.split_projection(self.in_proj(hidden))
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        out = torch.empty(
            hidden.shape[0],
            self.num_v_heads,
            self.shape.head_v_dim,
            dtype=hidden.dtype,
            device=hidden.device,
        )
        if meta.decode_rows:
            self._decode(meta, mixed, g, beta, conv_state, recurrent_state, out)
        for i in meta.prefill_rows:
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            if end > start:
                rows = slice(start, end)
                out[rows] = self._prefill(
                    meta, i, mixed[rows], g[rows], beta[rows], conv_state, recurrent_state
                )
        normed = self.norm(out, z)
        return self.out_proj(normed.reshape(hidden.shape[0], -1))

    def _qkv(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (repeated to the value heads, L2-normalised, q scaled) and v, float32."""
        tokens, shape = conv_out.shape[0], self.shape
        ratio = shape.num_v_heads // shape.num_k_heads
        q, k, v = torch.split(conv_out.float(), [self.key_dim, self.key_dim, self.value_dim], -1)
        q, k = (
            l2norm(x.reshape(tokens, self.num_k_heads, -1)).repeat_interleave(ratio, dim=1)
            for x in (q, k)
        )
        return q * shape.head_k_dim**-0.5, k, v.reshape(tokens, self.num_v_heads, -1)

    def _decode(
        self, meta: StateMetadata, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        conv_state: torch.Tensor, recurrent_state: torch.Tensor, out: torch.Tensor,
    ) -> None:  # fmt: skip
        """Every one-token request in one batched conv and recurrent step."""
        tokens, slots, fresh = meta.decode_tokens, meta.decode_slots, meta.decode_fresh
        conv = conv_state[slots].masked_fill(fresh[:, None, None], 0.0)
        window = torch.cat([conv, mixed[tokens].to(conv.dtype).unsqueeze(-1)], dim=-1)
        conv_state[slots] = window[..., 1:]
        conv_out = F.silu((window * self.conv1d.weight.to(window.dtype)).sum(-1)).to(mixed.dtype)
        q, k, v = self._qkv(conv_out)
        state = recurrent_state[slots].masked_fill(fresh[:, None, None, None], 0.0).float()
        core, state = recurrent_step(q, k, v, g[tokens], beta[tokens], state)
        recurrent_state[slots] = state.to(recurrent_state.dtype)
        out[tokens] = core.to(out.dtype)

    def _prefill(
        self, meta: StateMetadata, i: int, mixed: torch.Tensor, g: torch.Tensor,
        beta: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """Request i's run from its slot's state (zero for its first chunk); writes it back."""
        slot, is_first = meta.slot_list[i], meta.context_lens[i] == 0
        conv = torch.zeros_like(conv_state[slot]) if is_first else conv_state[slot]
        window = torch.cat([conv, mixed.t().to(conv.dtype)], dim=-1)  # [C, K - 1 + L]
        conv_state[slot] = window[:, window.shape[1] - conv.shape[1] :]
        weight = self.conv1d.weight.to(window.dtype).unsqueeze(1)
        conv_out = F.conv1d(window.unsqueeze(0), weight, groups=self.conv_dim)[0]
        q, k, v = self._qkv(F.silu(conv_out).t().to(mixed.dtype))
        state = torch.zeros_like(recurrent_state[slot]) if is_first else recurrent_state[slot]
        core, state = chunked_delta_rule(q, k, v, g, beta, state.float())
        recurrent_state[slot] = state.to(recurrent_state.dtype)
        return core.to(mixed.dtype)


class ConvWeight(nn.Module):
    """The depthwise conv1d's weight [channels, kernel]: this rank's rows of the checkpoint's
    [all channels, 1, kernel] (`rows`: (first row, rows) of its q, k and v channels)."""

    def __init__(
        self, channels: int, kernel: int, rows: list[tuple[int, int]], dtype: torch.dtype,
        device: torch.device,
    ) -> None:  # fmt: skip
        super().__init__()
        self.rows = rows
        self.weight = nn.Parameter(torch.empty(channels, kernel, dtype=dtype, device=device), False)

    def load(self, param_name: str, source: TensorSource, part: int = 0) -> None:
        if param_name != "weight":
            raise ValueError(f"the conv1d has no parameter {param_name!r}")
        offset = 0
        for start, size in self.rows:
            loaded = read_rows(source, start, size)
            copy_checked(self.weight[offset : offset + size], loaded.reshape(size, -1), param_name)
            offset += size


class GatedRMSNorm(nn.Module):
    """Per head: x / sqrt(mean(x^2) + eps) * weight * silu(gate), normalised in float32 and
    rounded to x's dtype before the weight (transformers' Qwen3NextRMSNormGated)."""

    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)

    def load(self, param_name: str, source: TensorSource, part: int = 0) -> None:
        copy_checked(self.weight, source[:], param_name)

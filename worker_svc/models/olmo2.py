"""OLMo 2 (`Olmo2ForCausalLM`): a Llama-shaped decoder with post-norms and q/k norms over the
whole projection.

As transformers' Olmo2 code computes it:
- no norm before attention or the MLP: their outputs are normalised
  (`post_attention_layernorm`, `post_feedforward_layernorm`) and then join the residual stream;
- q and k are RMS-normalised over the whole projection (all heads together, before the rope),
  not per head as Qwen3's; at tensor parallelism each rank holds its heads' rows of the norm
  weights and the ranks sum their squares (one all-reduce of two numbers per token), so the
  norm is the one over every head (a replicated KV head counts once: the group's sum is
  divided by the group's width).
"""

from __future__ import annotations

import torch
from torch import nn

from worker_svc.attention.backend import AttentionBackend
from worker_svc.layers.linear import first_kv_head
from worker_svc.layers.rmsnorm import RMSNorm
from worker_svc.layers.rotary import Rotation
from worker_svc.layers.tensor_source import TensorSource, copy_checked, read_rows
from worker_svc.models.decoder import BuildContext, DecoderForCausalLM, StepContext, join_prefix
from worker_svc.models.llama import LlamaAttention, LlamaMLP


class ProjectionNormWeight(nn.Module):
    """The weight rows [start, start + size) of a norm over a whole projection."""

    def __init__(self, start: int, size: int, build: BuildContext) -> None:
        super().__init__()
        self.start = start
        self.weight = nn.Parameter(
            torch.ones(size, dtype=build.dtype, device=build.device), requires_grad=False
        )

    def load(self, param_name: str, source: TensorSource, part: int = 0) -> None:
        copy_checked(self.weight, read_rows(source, self.start, self.weight.shape[0]), param_name)


class Olmo2Attention(LlamaAttention):
    """Llama's attention with q and k normalised over every head before the rope."""

    q_norm: ProjectionNormWeight
    k_norm: ProjectionNormWeight

    def __init__(
        self, build: BuildContext, backend: AttentionBackend, rotary: Rotation, prefix: str
    ) -> None:
        super().__init__(build, backend, rotary, prefix)
        config, parallel = build.config, build.parallel
        d, h, kvh = self.head_dim, self.num_heads, self.num_kv_heads
        self.parallel = parallel
        self.eps = config.rms_norm_eps
        kv_start = first_kv_head(config.num_kv_heads, parallel.tp_size, parallel.tp_rank) * d
        self.q_norm = ProjectionNormWeight(parallel.tp_rank * h * d, h * d, build)
        self.k_norm = ProjectionNormWeight(kv_start, kvh * d, build)

    def forward(
        self, hidden: torch.Tensor, ctx: StepContext, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(hidden)
        query, key = self._normalised(qkv[:, : h * d], qkv[:, h * d : (h + kvh) * d])
        query = self.rotary.rotate(query.view(num_tokens, h, d), ctx.cos, ctx.sin)
        key = self.rotary.rotate(key.view(num_tokens, kvh, d), ctx.cos, ctx.sin)
        value = qkv[:, (h + kvh) * d :].view(num_tokens, kvh, d)
        out = self.backend.forward(query, key, value, kv_cache, ctx.attn_metadata)
        return self.o_proj(out.reshape(num_tokens, h * d))

    def _normalised(
        self, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k RMS-normalised over the whole projection (every rank's rows), in float32
        and scaled by the weight there, as transformers' Olmo2RMSNorm."""
        q32, k32 = query.float(), key.float()
        squares = torch.stack((q32.square().sum(-1), k32.square().sum(-1)), dim=-1)
        squares = self.parallel.all_reduce(squares)
        tp = self.parallel.tp_size
        q_var = squares[:, :1] / (q32.shape[-1] * tp)
        k_var = squares[:, 1:] / (k32.shape[-1] * tp)
        q32 = q32 * torch.rsqrt(q_var + self.eps) * self.q_norm.weight.float()
        k32 = k32 * torch.rsqrt(k_var + self.eps) * self.k_norm.weight.float()
        return q32.to(query.dtype), k32.to(key.dtype)


class Olmo2DecoderLayer(nn.Module):
    """Attention and MLP outputs normalised, then added to the residual stream (deferred to the
    next layer's add, as in Llama)."""

    def __init__(
        self, build: BuildContext, backend: AttentionBackend, rotary: Rotation, prefix: str
    ) -> None:
        super().__init__()
        size, eps = build.config.hidden_size, build.config.rms_norm_eps
        dtype, device = build.dtype, build.device
        self.self_attn = Olmo2Attention(build, backend, rotary, join_prefix(prefix, "self_attn"))
        self.mlp = LlamaMLP(build, join_prefix(prefix, "mlp"))
        self.post_attention_layernorm = RMSNorm(size, eps, dtype=dtype, device=device)
        self.post_feedforward_layernorm = RMSNorm(size, eps, dtype=dtype, device=device)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: StepContext,
        kv_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = hidden if residual is None else residual + hidden
        attended = self.post_attention_layernorm(self.self_attn(residual, ctx, kv_cache))
        residual = residual + attended
        return self.post_feedforward_layernorm(self.mlp(residual)), residual


class Olmo2ForCausalLM(DecoderForCausalLM):
    """One pipeline stage of an OLMo 2 model (tensor names are Llama's)."""

    def make_layer(
        self, build: BuildContext, layer: int, backend: AttentionBackend, prefix: str
    ) -> nn.Module:
        return Olmo2DecoderLayer(build, backend, self.rotary, prefix)

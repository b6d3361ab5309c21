"""The Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) as one decoder built from our layers.

Flavours differ only in flags of `ModelConfig`: Qwen2 biases q/k/v, Qwen3 RMS-normalises q and
k per head before the rotary embedding, Llama 3.1 scales its rotary frequencies, Mistral's
layers attend within a sliding window. q/k/v and gate/up are fused into single matmuls at load
time. Other families build their decoders from these parts (`LlamaAttention`, `LlamaMLP`,
`LlamaDecoderLayer`) with pieces of their own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from worker_svc.attention.backend import AttentionBackend
from worker_svc.layers.activation import ACTIVATIONS
from worker_svc.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    kv_heads_per_rank,
)
from worker_svc.layers.rmsnorm import RMSNorm
from worker_svc.layers.rotary import Rotation
from worker_svc.layers.tensor_source import TensorSource
from worker_svc.models.decoder import BuildContext, DecoderForCausalLM, StepContext, join_prefix
from worker_svc.models.model_config import ModelConfig, architecture_of

NormFactory = Callable[..., nn.Module]
"""A norm class: (size, eps, *, dtype, device) -> module."""

_FLAVOURS: dict[str, dict[str, Any]] = {
    "Qwen2ForCausalLM": {"qkv_bias": True, "o_bias": False},  # q/k/v always biased, o never
    "Qwen3ForCausalLM": {"qk_norm": True},
}
for _qwen in ("Qwen2", "Qwen3"):  # the same decoders without an LM head, or with a classifier
    _FLAVOURS[f"{_qwen}Model"] = _FLAVOURS[f"{_qwen}ForSequenceClassification"] = _FLAVOURS[
        f"{_qwen}ForCausalLM"
    ]
"""What the Llama-family architectures other than Llama set beyond their config.json fields."""


class LlamaAttention(nn.Module):
    """Fused qkv projection, optional q/k norm, rotary, paged attention, row-parallel o_proj."""

    def __init__(
        self,
        build: BuildContext,
        backend: AttentionBackend,
        rotary: Rotation,
        prefix: str,
        qk_norm: NormFactory = RMSNorm,
    ) -> None:
        super().__init__()
        config, parallel, dtype, device = build.config, build.parallel, build.dtype, build.device
        d = config.head_dim
        self.num_heads = config.num_heads // parallel.tp_size
        self.num_kv_heads = kv_heads_per_rank(config.num_kv_heads, parallel.tp_size)
        self.head_dim = d
        self.backend = backend
        self.rotary = rotary
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            d,
            bias=config.qkv_bias,
            **build.linear_args(join_prefix(prefix, "qkv_proj")),
        )
        self.o_proj = RowParallelLinear(
            config.num_heads * d,
            config.hidden_size,
            bias=config.o_bias,
            **build.linear_args(join_prefix(prefix, "o_proj")),
        )
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if config.qk_norm:
            self.q_norm = qk_norm(d, config.rms_norm_eps, dtype=dtype, device=device)
            self.k_norm = qk_norm(d, config.rms_norm_eps, dtype=dtype, device=device)

    def forward(
        self, hidden: torch.Tensor, ctx: StepContext, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(hidden).view(num_tokens, h + 2 * kvh, d)
        value = qkv[:, h + kvh :]
        if self.q_norm is not None and self.k_norm is not None:
            query = self.rotary.rotate(self.q_norm(qkv[:, :h]), ctx.cos, ctx.sin)
            key = self.rotary.rotate(self.k_norm(qkv[:, h : h + kvh]), ctx.cos, ctx.sin)
        else:  # q and k together, in place where the CPU kernels rotate
            rotated = self.rotary(qkv[:, : h + kvh], ctx.positions, ctx.cos, ctx.sin)
            query, key = rotated[:, :h], rotated[:, h:]
        out = self.backend.forward(query, key, value, kv_cache, ctx.attn_metadata)
        return self.o_proj(out.reshape(num_tokens, h * d))

    def load(self, param: str, source: TensorSource, part: int) -> None:
        """The checkpoint's per-tensor KV-cache scale of this layer (`k_scale` / `v_scale`):
        an fp8 cache stores keys / k_scale and values / v_scale; the model's-dtype cache does
        not use them (as vLLM)."""
        scale = float(source[()].float().reshape(-1)[0])
        scales = self.backend.kv_scales
        if param == "k_scale":
            scales = replace(scales, k_scale=scale)
        elif param == "v_scale":
            scales = replace(scales, v_scale=scale)
        else:
            raise ValueError(f"the attention layer has no checkpoint tensor {param!r}")
        self.backend = self.backend.with_kv_scales(scales)


class LlamaMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused; the gated activation is the config's
    `hidden_act` (SiLU; Gemma's tanh GELU)."""

    def __init__(self, build: BuildContext, prefix: str) -> None:
        super().__init__()
        config, inter = build.config, build.config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size,
            [inter, inter],
            bias=config.mlp_bias,
            **build.linear_args(join_prefix(prefix, "gate_up_proj")),
        )
        self.act_fn = ACTIVATIONS[config.hidden_act]()
        self.down_proj = RowParallelLinear(
            inter,
            config.hidden_size,
            bias=config.mlp_bias,
            **build.linear_args(join_prefix(prefix, "down_proj")),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks; the residual add is fused into the next norm. A family
    may bring its own MLP or attention (gpt-oss: sparse experts, attention with sinks)."""

    def __init__(
        self,
        build: BuildContext,
        backend: AttentionBackend,
        rotary: Rotation,
        prefix: str,
        mlp: nn.Module | None = None,
        attention: nn.Module | None = None,
    ) -> None:
        super().__init__()
        config, dtype, device = build.config, build.dtype, build.device
        eps = config.rms_norm_eps
        if attention is None:
            attention = LlamaAttention(build, backend, rotary, join_prefix(prefix, "self_attn"))
        self.self_attn = attention
        self.mlp = LlamaMLP(build, join_prefix(prefix, "mlp")) if mlp is None else mlp
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: StepContext,
        kv_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(hidden, ctx, kv_cache)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(DecoderForCausalLM):
    """One pipeline stage of a Llama-family causal LM, sharded over the TP group."""

    @classmethod
    def read_config(cls, hf: Any) -> ModelConfig:
        config = ModelConfig.from_hf_config(hf)
        return replace(config, **_FLAVOURS.get(architecture_of(hf), {}))

    def make_layer(
        self, build: BuildContext, layer: int, backend: AttentionBackend, prefix: str
    ) -> nn.Module:
        return LlamaDecoderLayer(build, backend, self.rotary, prefix)

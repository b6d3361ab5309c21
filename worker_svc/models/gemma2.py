"""Gemma 2: the Llama decoder with Gemma's norms, embedding scale, GELU MLP and soft caps.

Differences from Llama, all in transformers' Gemma2 code:
- RMSNorm scales by (1 + w), computed in float32 (`GemmaRMSNorm`);
- four norms per layer: input, post-attention, pre- and post-feedforward (the attention and
  MLP outputs are normalised before they join the residual stream);
- token embeddings are multiplied by sqrt(hidden_size), rounded to the compute dtype;
- the MLP is gelu_tanh(gate) * up;
- attention scales scores by query_pre_attn_scalar ** -0.5 and caps them at
  attn_logit_softcapping; final logits are capped at final_logit_softcapping;
- layers alternate sliding-window (local) and full (global) attention (`layer_types`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.attention.backend import AttentionBackend
from worker_svc.distributed import ParallelState
from worker_svc.layers.activation import gelu_tanh_and_mul
from worker_svc.layers.tensor_source import TensorSource, copy_checked
from worker_svc.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    StepContext,
)
from worker_svc.models.model_config import ModelConfig


class GemmaRMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * (1 + weight), in float32, cast back to x's dtype."""

    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.normalized_shape = (size,)
        self.eps = eps
        self.weight = nn.Parameter(
            torch.zeros(size, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.normalized_shape, None, self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)

    def load(self, param_name: str, source: TensorSource, part: int = 0) -> None:
        copy_checked(self.weight, source[:], param_name)


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap); x unchanged without a cap."""
    return x if cap is None else torch.tanh(x / cap) * cap


class GemmaMLP(LlamaMLP):
    """down(gelu_tanh(gate(x)) * up(x)) with gate and up fused."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    """Sandwich norms around attention and MLP; the residual add is deferred to the next layer
    (as in Llama), so stages exchange (hidden, residual) unchanged."""

    def __init__(
        self, attention: LlamaAttention, mlp: nn.Module, config: ModelConfig, is_local: bool
    ) -> None:
        super().__init__()
        self.is_local = is_local
        self.self_attn = attention
        self.mlp = mlp
        size, eps = config.hidden_size, config.rms_norm_eps
        dtype, device = attention.o_proj.weight.dtype, attention.o_proj.weight.device
        self.input_layernorm = GemmaRMSNorm(size, eps, dtype=dtype, device=device)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, dtype=dtype, device=device)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype=dtype, device=device)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype=dtype, device=device)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: StepContext,
        kv_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = hidden if residual is None else residual + hidden
        attended = self.self_attn(self.input_layernorm(residual), ctx, kv_cache)
        residual = residual + self.post_attention_layernorm(attended)
        out = self.mlp(self.pre_feedforward_layernorm(residual))
        return self.post_feedforward_layernorm(out), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    """One pipeline stage of a Gemma 2 model (Gemma 3 adds q/k norms and a local rope)."""

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelState,
        backend: AttentionBackend,
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        context_len: int | None = None,
    ) -> None:
        super().__init__(
            config,
            parallel,
            backend,
            dtype=dtype,
            device=device,
            max_positions=max_positions,
            context_len=context_len,
        )
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=dtype, device=device)
        if self.norm is not None:
            self.norm = GemmaRMSNorm(  # type: ignore[assignment]
                config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device
            )

    def _make_layer(  # type: ignore[override]
        self, layer: int, backend: AttentionBackend, dtype: torch.dtype, device: torch.device
    ) -> GemmaDecoderLayer:
        config, parallel = self.config, self.parallel
        attention = LlamaAttention(config, parallel, backend, self.rotary, dtype, device)
        mlp = GemmaMLP(config, parallel, dtype, device)
        return GemmaDecoderLayer(attention, mlp, config, config.layer_window(layer) is not None)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        ctx: StepContext,
        kv_caches: list[torch.Tensor],
        hidden: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.embed_tokens is not None:
            assert input_ids is not None
            hidden = self.embed_tokens(input_ids) * self.embed_scale
        assert hidden is not None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, self.layer_context(layer, ctx), kv_cache)
        if self.norm is not None:
            assert residual is not None
            return self.norm(residual + hidden), None
        return hidden, residual

    def layer_context(self, layer: nn.Module, ctx: StepContext) -> StepContext:
        """The step context a layer attends with (Gemma 3 gives local layers their own rope)."""
        return ctx

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return soft_cap(super().compute_logits(hidden), self.config.final_logit_softcapping)

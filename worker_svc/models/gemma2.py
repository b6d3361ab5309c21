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

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.attention.backend import AttentionBackend, AttentionOptions
from worker_svc.layers.rope_config import RopeConfig, layer_type_rope_configs
from worker_svc.layers.tensor_source import TensorSource, copy_checked
from worker_svc.models.decoder import (
    BuildContext,
    DecoderForCausalLM,
    ResidualNorm,
    StepContext,
    join_prefix,
)
from worker_svc.models.llama import LlamaAttention, LlamaMLP
from worker_svc.models.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class GemmaConfig(ModelConfig):
    """Gemma's knobs beyond every decoder's."""

    activations: ClassVar[tuple[str, ...]] = ("gelu_pytorch_tanh",)

    attn_scale: float | None = None
    """Softmax scale when not head_dim ** -0.5 (query_pre_attn_scalar ** -0.5)."""
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    local_rope: RopeConfig | None = None
    """Rope of the sliding-window layers when it differs (Gemma 3's local base frequency)."""

    def layer_attention(self, layer: int) -> AttentionOptions:
        return AttentionOptions(
            sliding_window=self.layer_window(layer),
            logits_soft_cap=self.attn_logit_softcapping,
            scale=self.attn_scale,
        )

    @classmethod
    def read(cls, hf: Any, **fields: Any) -> GemmaConfig:
        scalar = getattr(hf, "query_pre_attn_scalar", None)
        cap = getattr(hf, "attn_logit_softcapping", None)
        read: dict[str, Any] = {
            "attn_scale": None if scalar is None else float(scalar) ** -0.5,
            "attn_logit_softcapping": None if cap is None else float(cap),
            "final_logit_softcapping": getattr(hf, "final_logit_softcapping", None),
            "local_rope": layer_type_rope_configs(hf)[1],
        }
        return cls.from_hf_config(hf, **{**read, **fields})


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

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), as RMSNorm's."""
        residual = x if residual is None else residual + x
        return self(residual), residual

    def load(self, param_name: str, source: TensorSource, part: int = 0) -> None:
        copy_checked(self.weight, source[:], param_name)


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap); x unchanged without a cap."""
    return x if cap is None else torch.tanh(x / cap) * cap


class GemmaDecoderLayer(nn.Module):
    """Sandwich norms around attention and MLP; the residual add is deferred to the next layer
    (as in Llama), so stages exchange (hidden, residual) unchanged."""

    def __init__(self, build: BuildContext, attention: LlamaAttention, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        size, eps = build.config.hidden_size, build.config.rms_norm_eps
        dtype, device = build.dtype, build.device
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


class Gemma2ForCausalLM(DecoderForCausalLM):
    """One pipeline stage of a Gemma 2 model (Gemma 3 adds q/k norms and a local rope)."""

    config: GemmaConfig

    def __init__(self, build: BuildContext, prefix: str = "") -> None:
        super().__init__(build, prefix)
        config = build.config
        self.embed_scale = torch.tensor(
            config.hidden_size**0.5, dtype=build.dtype, device=build.device
        )

    @classmethod
    def read_config(cls, hf: Any) -> ModelConfig:
        return GemmaConfig.read(hf)

    def make_layer(
        self, build: BuildContext, layer: int, backend: AttentionBackend, prefix: str
    ) -> nn.Module:
        attention = LlamaAttention(build, backend, self.rotary, join_prefix(prefix, "self_attn"))
        return GemmaDecoderLayer(build, attention, LlamaMLP(build, join_prefix(prefix, "mlp")))

    def make_norm(self, build: BuildContext) -> ResidualNorm:
        config = build.config
        return GemmaRMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype=build.dtype, device=build.device
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed_input_ids(input_ids) * self.embed_scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return soft_cap(super().compute_logits(hidden), self.config.final_logit_softcapping)

"""IBM Granite (3.x, `GraniteForCausalLM`): the Llama decoder with four scalars of its own.

As transformers' Granite code applies them: token embeddings are multiplied by
`embedding_multiplier`; attention scores are scaled by `attention_multiplier` (instead of
head_dim ** -0.5); the attention and MLP outputs are multiplied by `residual_multiplier` before
they join the residual stream; logits are divided by `logits_scaling`. Checkpoint tensor names
are Llama's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from worker_svc.attention.backend import AttentionBackend, AttentionOptions
from worker_svc.layers.rotary import RotaryEmbedding
from worker_svc.models.decoder import BuildContext, DecoderForCausalLM, StepContext
from worker_svc.models.llama import LlamaDecoderLayer
from worker_svc.models.model_config import ModelConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class GraniteConfig(ModelConfig):
    """Granite's multipliers beyond every decoder's fields."""

    embedding_multiplier: float
    residual_multiplier: float
    attention_multiplier: float
    logits_scaling: float

    def layer_attention(self, layer: int) -> AttentionOptions:
        return AttentionOptions(
            sliding_window=self.layer_window(layer), scale=self.attention_multiplier
        )


class GraniteDecoderLayer(LlamaDecoderLayer):
    """Llama's layer, its attention and MLP outputs scaled before the residual add."""

    def __init__(
        self,
        build: BuildContext,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
        prefix: str,
        residual_multiplier: float,
    ) -> None:
        super().__init__(build, backend, rotary, prefix)
        self.residual_multiplier = residual_multiplier

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: StepContext,
        kv_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(hidden, ctx, kv_cache) * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden) * self.residual_multiplier, residual


class GraniteForCausalLM(DecoderForCausalLM):
    """One pipeline stage of a Granite model."""

    config: GraniteConfig

    @classmethod
    def read_config(cls, hf: Any) -> ModelConfig:
        return GraniteConfig.from_hf_config(
            hf,
            embedding_multiplier=float(hf.embedding_multiplier),
            residual_multiplier=float(hf.residual_multiplier),
            attention_multiplier=float(hf.attention_multiplier),
            logits_scaling=float(hf.logits_scaling),
        )

    def make_layer(
        self, build: BuildContext, layer: int, backend: AttentionBackend, prefix: str
    ) -> nn.Module:
        assert isinstance(build.config, GraniteConfig)
        multiplier = build.config.residual_multiplier
        return GraniteDecoderLayer(build, backend, self.rotary, prefix, multiplier)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed_input_ids(input_ids) * self.config.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.config.logits_scaling

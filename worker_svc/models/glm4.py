"""GLM-4 (`Glm4ForCausalLM`, GLM-4-9B-0414 and GLM-4-32B): a Llama-shaped decoder with four
norms per layer and a GPT-J-style partial rotary.

As transformers' Glm4 code computes it:
- attention and MLP outputs are normalised before they join the residual stream
  (`post_self_attn_layernorm`, `post_mlp_layernorm`), beside the usual pre-norms
  (`input_layernorm` before attention, `post_attention_layernorm` before the MLP);
- the rotary embedding turns adjacent pairs of dimensions (`is_neox_style` False) and only the
  first `partial_rotary_factor` of each head (0.5 by default);
- q/k/v are biased (`attention_bias`), o_proj never;
- checkpoints store gate and up fused (`mlp.gate_up_proj`), split at load for tensor parallelism.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from worker_svc.attention.backend import AttentionBackend
from worker_svc.layers.rmsnorm import RMSNorm
from worker_svc.models.decoder import (
    BuildContext,
    DecoderForCausalLM,
    StepContext,
    join_prefix,
)
from worker_svc.models.llama import LlamaAttention, LlamaMLP
from worker_svc.models.model_config import ModelConfig
from worker_svc.models.weight_names import WeightTarget, fused_targets, resolve_weight_name

_GATE_UP = "mlp.gate_up_proj.weight"
_NORMS = ("post_self_attn_layernorm", "post_mlp_layernorm")


class Glm4DecoderLayer(nn.Module):
    """Pre- and post-norms around attention and the MLP; the residual add is deferred to the
    next layer (as in Llama), so stages exchange (hidden, residual) unchanged."""

    def __init__(self, build: BuildContext, attention: LlamaAttention, prefix: str) -> None:
        super().__init__()
        self.self_attn = attention
        self.mlp = LlamaMLP(build, join_prefix(prefix, "mlp"))
        size, eps = build.config.hidden_size, build.config.rms_norm_eps
        args: dict[str, Any] = {"dtype": build.dtype, "device": build.device}
        self.input_layernorm = RMSNorm(size, eps, **args)
        self.post_self_attn_layernorm = RMSNorm(size, eps, **args)
        self.post_attention_layernorm = RMSNorm(size, eps, **args)
        self.post_mlp_layernorm = RMSNorm(size, eps, **args)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: StepContext,
        kv_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        attended = self.post_self_attn_layernorm(self.self_attn(hidden, ctx, kv_cache))
        hidden, residual = self.post_attention_layernorm.add_and_norm(attended, residual)
        return self.post_mlp_layernorm(self.mlp(hidden)), residual


class Glm4ForCausalLM(DecoderForCausalLM):
    """One pipeline stage of a GLM-4 model."""

    @classmethod
    def read_config(cls, hf: Any) -> ModelConfig:
        config = ModelConfig.from_hf_config(hf)
        rope = replace(config.rope, is_neox_style=False)
        return replace(config, rope=rope, o_bias=False)

    def make_layer(
        self, build: BuildContext, layer: int, backend: AttentionBackend, prefix: str
    ) -> nn.Module:
        attention = LlamaAttention(build, backend, self.rotary, join_prefix(prefix, "self_attn"))
        return Glm4DecoderLayer(build, attention, prefix)

    def resolve_weight_name(self, name: str) -> list[WeightTarget]:
        layer, _, suffix = name.removeprefix("model.layers.").partition(".")
        if not name.startswith("model.layers."):
            return resolve_weight_name(name, self.config.tie_word_embeddings)
        if suffix == _GATE_UP:
            sizes = [self.config.intermediate_size] * 2
            return fused_targets(int(layer), "mlp.gate_up_proj", sizes)
        module, _, param = suffix.rpartition(".")
        if module in _NORMS:
            return [WeightTarget(int(layer), module, param)]
        return resolve_weight_name(name, self.config.tie_word_embeddings)

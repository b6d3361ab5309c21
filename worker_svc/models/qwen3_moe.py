"""Qwen3-MoE: Qwen3's attention (q/k norms) with sparse MLPs, except in `mlp_only_layers`.

Routing: softmax over the experts, the top-k, renormalised only with norm_topk_prob.
Checkpoint names: `mlp.gate` is the router, `mlp.experts.{e}.gate_proj` / `up_proj` /
`down_proj` expert e's projections; dense layers keep the Llama MLP names.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from worker_svc.attention.backend import AttentionBackend
from worker_svc.models.decoder import BuildContext, DecoderForCausalLM
from worker_svc.models.mixtral import (
    MoeModelConfig,
    expert_target,
    moe_decoder_layer,
    read_moe_config,
)
from worker_svc.models.model_config import ModelConfig
from worker_svc.models.weight_names import WeightTarget, resolve_weight_name

_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)_proj\.weight$")
_ROUTER = re.compile(r"^model\.layers\.(\d+)\.mlp\.gate\.weight$")


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    """The sparse layers' MLP is a SparseMoeBlock (as Mixtral's), the attention Qwen3's."""

    @classmethod
    def read_config(cls, hf: Any) -> ModelConfig:
        moe = read_moe_config(hf, renormalize=bool(getattr(hf, "norm_topk_prob", False)))
        return MoeModelConfig.from_hf_config(hf, qk_norm=True, moe=moe)

    def make_layer(
        self, build: BuildContext, layer: int, backend: AttentionBackend, prefix: str
    ) -> nn.Module:
        return moe_decoder_layer(build, layer, backend, self.rotary, prefix)

    def resolve_weight_name(self, name: str) -> list[WeightTarget]:
        if match := _EXPERT.match(name):
            return [expert_target(int(match.group(1)), int(match.group(2)), match.group(3))]
        if match := _ROUTER.match(name):
            return [WeightTarget(int(match.group(1)), "mlp.gate", "weight")]
        return resolve_weight_name(name, self.config.tie_word_embeddings)

"""Qwen3-MoE: Qwen3's attention (q/k norms) with sparse MLPs, except in `mlp_only_layers`.

Routing: softmax over the experts, the top-k, renormalised only with norm_topk_prob.
Checkpoint names: `mlp.gate` is the router, `mlp.experts.{e}.gate_proj` / `up_proj` /
`down_proj` expert e's projections; dense layers keep the Llama MLP names.
"""

from __future__ import annotations

import re
from typing import Any

from worker_svc.models.mixtral import MoeModelConfig, SparseMoeForCausalLM, read_moe_config
from worker_svc.models.model_config import ModelConfig


class Qwen3MoeForCausalLM(SparseMoeForCausalLM):
    """Qwen3's attention (q/k norms); the sparse layers' MLPs as Mixtral's."""

    expert_name = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)_proj\.weight$")
    router_name = re.compile(r"^model\.layers\.(\d+)\.mlp\.gate\.weight$")

    @classmethod
    def read_config(cls, hf: Any) -> ModelConfig:
        moe = read_moe_config(hf, renormalize=bool(getattr(hf, "norm_topk_prob", False)))
        return MoeModelConfig.from_hf_config(hf, qk_norm=True, moe=moe)

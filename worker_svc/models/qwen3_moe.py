"""Qwen3-MoE: Qwen3's attention (q/k norms) with sparse MLPs, except in `mlp_only_layers`.

Routing: softmax over the experts, the top-k, renormalised only with norm_topk_prob.
Checkpoint names: `mlp.gate` is the router, `mlp.experts.{e}.gate_proj` / `up_proj` /
`down_proj` expert e's projections; dense layers keep the Llama MLP names.
"""

from __future__ import annotations

import re

from worker_svc.models.mixtral import MixtralForCausalLM, expert_target
from worker_svc.models.weight_names import WeightTarget, resolve_weight_name

_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)_proj\.weight$")
_ROUTER = re.compile(r"^model\.layers\.(\d+)\.mlp\.gate\.weight$")


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    """The sparse layers' MLP is a SparseMoeBlock (MixtralForCausalLM's `_make_mlp`)."""

    def resolve_weight_name(self, name: str) -> list[WeightTarget]:
        if match := _EXPERT.match(name):
            return [expert_target(int(match.group(1)), int(match.group(2)), match.group(3))]
        if match := _ROUTER.match(name):
            return [WeightTarget(int(match.group(1)), "mlp.gate", "weight")]
        return resolve_weight_name(name, self.config.tie_word_embeddings)

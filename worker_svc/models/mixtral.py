"""Mixtral: the Llama decoder whose MLPs are sparse mixtures of experts (layers/moe.py).

Routing: softmax over the experts, the top-k, renormalised (a softmax over the top-k logits).
Checkpoint names: `block_sparse_moe.gate` is the router, `block_sparse_moe.experts.{e}.w1` / `w3`
/ `w2` expert e's gate / up / down projections.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from worker_svc.layers.moe import SparseMoeBlock
from worker_svc.models.llama import LlamaForCausalLM
from worker_svc.models.weight_names import WeightTarget, resolve_weight_name

_EXPERT = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
_ROUTER = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight$")


def expert_target(layer: int, expert: int, projection: str) -> WeightTarget:
    """Where expert `expert`'s "gate", "up" or "down" projection goes in a SparseMoeBlock."""
    if projection == "down":
        return WeightTarget(layer, "mlp.experts", "w2_weight", expert)
    return WeightTarget(layer, "mlp.experts", "w13_weight", 2 * expert + (projection == "up"))


class MixtralForCausalLM(LlamaForCausalLM):
    """Every decoder layer's MLP is a SparseMoeBlock."""

    def _make_mlp(self, layer: int, dtype: torch.dtype, device: torch.device) -> nn.Module | None:
        moe = self.config.moe
        if moe is None or not moe.sparse_layers[layer]:
            return None
        return SparseMoeBlock(
            self.config.hidden_size, moe, parallel=self.parallel, dtype=dtype, device=device
        )

    def resolve_weight_name(self, name: str) -> list[WeightTarget]:
        if match := _EXPERT.match(name):
            projection = {"w1": "gate", "w3": "up", "w2": "down"}[match.group(3)]
            return [expert_target(int(match.group(1)), int(match.group(2)), projection)]
        if match := _ROUTER.match(name):
            return [WeightTarget(int(match.group(1)), "mlp.gate", "weight")]
        return resolve_weight_name(name, self.config.tie_word_embeddings)

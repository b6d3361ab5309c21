"""Mixtral: the Llama decoder whose MLPs are sparse mixtures of experts (layers/moe.py).

Routing: softmax over the experts, the top-k, renormalised (a softmax over the top-k logits).
Checkpoint names: `block_sparse_moe.gate` is the router, `block_sparse_moe.experts.{e}.w1` / `w3`
/ `w2` expert e's gate / up / down projections.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from worker_svc.attention.backend import AttentionBackend
from worker_svc.layers.moe import MoeConfig, SparseMoeBlock
from worker_svc.models.decoder import BuildContext, DecoderForCausalLM
from worker_svc.models.llama import LlamaDecoderLayer
from worker_svc.models.model_config import ModelConfig
from worker_svc.models.weight_names import WeightTarget


@dataclass(frozen=True, slots=True, kw_only=True)
class MoeModelConfig(ModelConfig):
    """A decoder whose MLPs are sparse mixtures of experts (in `moe.sparse_layers`)."""

    moe: MoeConfig


def read_moe_config(hf: Any, renormalize: bool) -> MoeConfig:
    """The experts' shape from config.json (Mixtral's num_local_experts, Qwen3-MoE's
    num_experts, moe_intermediate_size, mlp_only_layers and decoder_sparse_step)."""
    num_experts = getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None)
    if not num_experts:
        raise ValueError("config.json of a mixture-of-experts model names no experts")
    num_layers = int(hf.num_hidden_layers)
    dense = set(getattr(hf, "mlp_only_layers", None) or ())
    step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
    return MoeConfig(
        num_experts=int(num_experts),
        top_k=int(hf.num_experts_per_tok),
        intermediate_size=int(getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size),
        renormalize=renormalize,
        sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)),
    )


def expert_target(layer: int, expert: int, projection: str) -> WeightTarget:
    """Where expert `expert`'s "gate", "up" or "down" projection goes in a SparseMoeBlock."""
    if projection == "down":
        return WeightTarget(layer, "mlp.experts", "w2_weight", expert)
    return WeightTarget(layer, "mlp.experts", "w13_weight", 2 * expert + (projection == "up"))


class SparseMoeForCausalLM(DecoderForCausalLM):
    """A decoder whose layers' MLPs are SparseMoeBlocks where `moe.sparse_layers` says so (the
    Llama MLP elsewhere). A family names its checkpoint's expert and router tensors: `expert_name`
    matches (layer, expert, projection), `projections` maps the checkpoint's projection names to
    gate / up / down."""

    expert_name: ClassVar[re.Pattern[str]]
    router_name: ClassVar[re.Pattern[str]]
    projections: ClassVar[dict[str, str]] = {"gate": "gate", "up": "up", "down": "down"}

    def make_layer(
        self, build: BuildContext, layer: int, backend: AttentionBackend, prefix: str
    ) -> nn.Module:
        config = build.config
        assert isinstance(config, MoeModelConfig)
        mlp = None
        if config.moe.sparse_layers[layer]:
            mlp = SparseMoeBlock(
                config.hidden_size,
                config.moe,
                parallel=build.parallel,
                dtype=build.dtype,
                device=build.device,
            )
        return LlamaDecoderLayer(build, backend, self.rotary, prefix, mlp=mlp)

    def resolve_weight_name(self, name: str) -> list[WeightTarget]:
        if match := self.expert_name.match(name):
            projection = self.projections[match.group(3)]
            return [expert_target(int(match.group(1)), int(match.group(2)), projection)]
        if match := self.router_name.match(name):
            return [WeightTarget(int(match.group(1)), "mlp.gate", "weight")]
        return super().resolve_weight_name(name)


class MixtralForCausalLM(SparseMoeForCausalLM):
    """Every decoder layer's MLP is a SparseMoeBlock."""

    expert_name = re.compile(
        r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$"
    )
    router_name = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight$")
    projections = {"w1": "gate", "w3": "up", "w2": "down"}

    @classmethod
    def read_config(cls, hf: Any) -> ModelConfig:
        return MoeModelConfig.from_hf_config(hf, moe=read_moe_config(hf, renormalize=True))

"""SmolLM3 (`SmolLM3ForCausalLM`): the Llama decoder with NoPE layers.

transformers' SmolLM3 rotates queries and keys only in the layers its config's
`no_rope_layers` marks 1 (by default three layers in four; every fourth layer has no positional
encoding at all, "NoPE"). With `use_sliding_window`, `layer_types` says which layers attend
within the window (by default the NoPE ones), which `ModelConfig` reads as for every family.
Checkpoint tensor names are Llama's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from worker_svc.attention.backend import AttentionBackend
from worker_svc.layers.rotary import NoPositionEmbedding
from worker_svc.models.decoder import BuildContext
from worker_svc.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from worker_svc.models.model_config import ModelConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class SmolLM3Config(ModelConfig):
    """Which layers rotate (transformers' `no_rope_layers`: 1 rotates, 0 is NoPE)."""

    rope_layers: tuple[bool, ...]


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """One pipeline stage of a SmolLM3 model."""

    @classmethod
    def read_config(cls, hf: Any) -> ModelConfig:
        layers = tuple(bool(flag) for flag in hf.no_rope_layers)
        if len(layers) != int(hf.num_hidden_layers):
            raise ValueError(
                f"no_rope_layers has {len(layers)} entries for {hf.num_hidden_layers} layers"
            )
        return SmolLM3Config.from_hf_config(hf, rope_layers=layers)

    def make_layer(
        self, build: BuildContext, layer: int, backend: AttentionBackend, prefix: str
    ) -> nn.Module:
        assert isinstance(build.config, SmolLM3Config)
        rotary = self.rotary if build.config.rope_layers[layer] else NoPositionEmbedding()
        return LlamaDecoderLayer(build, backend, rotary, prefix)

"""Gemma 3 (text, Gemma3ForCausalLM): Gemma 2 plus (1 + w) RMS norms on q and k per head, and a
separate rope for the sliding-window (local) layers: five local layers to one global by default,
the local ones with their own base frequency (10 000), the global ones with the main rope
(1 000 000, often linearly scaled). transformers' Gemma 3 applies no attention soft cap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from worker_svc.attention.backend import AttentionBackend
from worker_svc.models.decoder import BuildContext, StepContext, join_prefix
from worker_svc.models.gemma2 import (
    Gemma2ForCausalLM,
    GemmaConfig,
    GemmaDecoderLayer,
    GemmaRMSNorm,
)
from worker_svc.models.llama import LlamaAttention, LlamaMLP
from worker_svc.models.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class LocalRopeContext(StepContext):
    """The step context of global layers, with `local` the one of sliding-window layers."""

    local: StepContext | None = None


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """One pipeline stage of a Gemma 3 text model."""

    def __init__(self, build: BuildContext, prefix: str = "") -> None:
        super().__init__(build, prefix)
        local_rope = self.config.local_rope
        self.local_rotary = None if local_rope is None else build.rotary(local_rope)
        start, end = self.layer_range
        self.is_local = [self.config.is_sliding_layer(i) for i in range(start, end)]
        """Per layer of this stage: whether it is a local layer (with the local rope)."""

    @classmethod
    def read_config(cls, hf: Any) -> ModelConfig:
        """Gemma 3 normalises q and k; transformers' Gemma 3 never applies the attention soft
        cap its config may carry."""
        return GemmaConfig.read(hf, qk_norm=True, attn_logit_softcapping=None)

    def make_layer(
        self, build: BuildContext, layer: int, backend: AttentionBackend, prefix: str
    ) -> nn.Module:
        attention = LlamaAttention(
            build, backend, self.rotary, join_prefix(prefix, "self_attn"), qk_norm=GemmaRMSNorm
        )
        return GemmaDecoderLayer(build, attention, LlamaMLP(build, join_prefix(prefix, "mlp")))

    def step_context(self, positions: torch.Tensor, attn_metadata: object) -> StepContext:
        cos, sin = self.rotary.cos_sin(positions)
        local = None
        if self.local_rotary is not None:
            local = StepContext(*self.local_rotary.cos_sin(positions), attn_metadata, positions)
        return LocalRopeContext(cos, sin, attn_metadata, positions, local=local)

    def layer_contexts(self, ctx: StepContext) -> Sequence[StepContext]:
        if not isinstance(ctx, LocalRopeContext) or ctx.local is None:
            return super().layer_contexts(ctx)
        return [ctx.local if is_local else ctx for is_local in self.is_local]

"""Gemma 3 (text, Gemma3ForCausalLM): Gemma 2 plus (1 + w) RMS norms on q and k per head, and a
separate rope for the sliding-window (local) layers: five local layers to one global by default,
the local ones with their own base frequency (10 000), the global ones with the main rope
(1 000 000, often linearly scaled). transformers' Gemma 3 applies no attention soft cap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from worker_svc.attention.backend import AttentionBackend
from worker_svc.distributed import ParallelState
from worker_svc.layers.rotary import RotaryEmbedding
from worker_svc.models.gemma2 import Gemma2ForCausalLM, GemmaDecoderLayer, GemmaRMSNorm
from worker_svc.models.llama import StepContext
from worker_svc.models.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class LocalRopeContext(StepContext):
    """The step context of global layers, with `local` the one of sliding-window layers."""

    local: StepContext | None = None


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """One pipeline stage of a Gemma 3 text model."""

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelState,
        backend: AttentionBackend,
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        context_len: int | None = None,
    ) -> None:
        super().__init__(
            config,
            parallel,
            backend,
            dtype=dtype,
            device=device,
            max_positions=max_positions,
            context_len=context_len,
        )
        self.local_rotary: RotaryEmbedding | None = None
        if config.local_rope is not None:
            self.local_rotary = RotaryEmbedding(
                config.head_dim,
                max_positions,
                config.local_rope,
                dtype=dtype,
                device=device,
                context_len=context_len,
            )

    def _make_layer(  # type: ignore[override]
        self, layer: int, backend: AttentionBackend, dtype: torch.dtype, device: torch.device
    ) -> GemmaDecoderLayer:
        decoder_layer = super()._make_layer(layer, backend, dtype, device)
        attention, config = decoder_layer.self_attn, self.config
        attention.q_norm = GemmaRMSNorm(  # type: ignore[assignment]
            config.head_dim, config.rms_norm_eps, dtype=dtype, device=device
        )
        attention.k_norm = GemmaRMSNorm(  # type: ignore[assignment]
            config.head_dim, config.rms_norm_eps, dtype=dtype, device=device
        )
        return decoder_layer

    def step_context(self, positions: torch.Tensor, attn_metadata: object) -> StepContext:
        cos, sin = self.rotary.cos_sin(positions)
        local = None
        if self.local_rotary is not None:
            local = StepContext(*self.local_rotary.cos_sin(positions), attn_metadata, positions)
        return LocalRopeContext(cos, sin, attn_metadata, positions, local)

    def layer_context(self, layer: nn.Module, ctx: StepContext) -> StepContext:
        is_local = isinstance(layer, GemmaDecoderLayer) and layer.is_local
        if is_local and isinstance(ctx, LocalRopeContext) and ctx.local is not None:
            return ctx.local
        return ctx

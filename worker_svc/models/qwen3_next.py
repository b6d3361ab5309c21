"""Qwen3-Next: gated DeltaNet layers (layers/gated_deltanet.py) beside gated full-attention
layers, every layer's MLP a mixture of experts with a shared expert (vLLM's
Qwen3NextForCausalLM).

Full attention: q_proj emits per head [query (d), gate (d)]; q and k RMS-normalised per head
with (1 + w), a partial rotary (`partial_rotary_factor`), paged attention, the output times
sigmoid(gate), then o_proj. The MLP: softmax top-k routing (renormalised with norm_topk_prob)
plus a shared expert scaled by sigmoid(shared_expert_gate(x)); a layer in `mlp_only_layers`
(or off `decoder_sparse_step`) has a dense MLP. Every norm scales by (1 + w).

The model is hybrid (interfaces.IsHybrid): a linear_attention layer keeps a fixed-size state
per request (its `state_specs` entry), a full_attention layer paged KV (None there).
Checkpoint tensors are transformers' names; the multi-token-prediction head (`mtp.*`) is not
served and its tensors are skipped.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from worker_svc.attention.backend import AttentionBackend
from worker_svc.layers.gated_deltanet import CHECKPOINT_TENSORS, DeltaNetShape, GatedDeltaNet
from worker_svc.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    first_kv_head,
    kv_heads_per_rank,
)
from worker_svc.layers.moe import FusedExperts, MoeConfig, MoeRouter, route
from worker_svc.layers.rotary import Rotation
from worker_svc.layers.state_cache import LayerCache, StateSpec
from worker_svc.models.decoder import (
    BuildContext,
    DecoderForCausalLM,
    ResidualNorm,
    StepContext,
    join_prefix,
)
from worker_svc.models.gemma2 import GemmaRMSNorm
from worker_svc.models.llama import LlamaMLP
from worker_svc.models.mixtral import expert_target
from worker_svc.models.model_config import ModelConfig
from worker_svc.models.weight_names import WeightTarget

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"

_LINEAR_ATTN = re.compile(r"^model\.layers\.(\d+)\.linear_attn\.(.+)$")
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_MLP_MODULE = re.compile(r"^model\.layers\.(\d+)\.mlp\.(gate|shared_expert_gate)\.weight$")
_SHARED = re.compile(r"^model\.layers\.(\d+)\.mlp\.shared_expert\.(gate|up|down)_proj\.weight$")


@dataclass(frozen=True, slots=True, kw_only=True)
class Qwen3NextConfig(ModelConfig):
    """Qwen3-Next's own fields: each layer's kind, the DeltaNet shape, the experts."""

    layer_kinds: tuple[str, ...]
    deltanet: DeltaNetShape
    moe: MoeConfig
    shared_expert_intermediate_size: int


def read_qwen3_next_config(hf: Any) -> Qwen3NextConfig:
    """The config, refusing by name what this code does not implement."""
    if getattr(hf, "attention_bias", False):
        raise ValueError("Qwen3-Next with attention_bias is not supported")
    num_layers = int(hf.num_hidden_layers)
    kinds = tuple(str(k) for k in hf.layer_types)
    unknown = sorted(set(kinds) - {LINEAR_ATTENTION, FULL_ATTENTION})
    if unknown or len(kinds) != num_layers:
        raise ValueError(f"Qwen3-Next layer_types {list(kinds)} are not supported")
    num_experts = int(getattr(hf, "num_experts", 0) or 0)
    if num_experts and not getattr(hf, "shared_expert_intermediate_size", 0):
        raise ValueError("Qwen3-Next without a shared expert is not supported")
    dense = set(getattr(hf, "mlp_only_layers", None) or ())
    step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
    moe = MoeConfig(
        num_experts=num_experts,
        top_k=int(hf.num_experts_per_tok),
        intermediate_size=int(hf.moe_intermediate_size),
        renormalize=bool(hf.norm_topk_prob),
        sparse_layers=tuple(
            num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(num_layers)
        ),
    )
    deltanet = DeltaNetShape(
        hidden_size=int(hf.hidden_size),
        num_k_heads=int(hf.linear_num_key_heads),
        num_v_heads=int(hf.linear_num_value_heads),
        head_k_dim=int(hf.linear_key_head_dim),
        head_v_dim=int(hf.linear_value_head_dim),
        conv_kernel=int(hf.linear_conv_kernel_dim),
        eps=float(hf.rms_norm_eps),
    )
    return Qwen3NextConfig.from_hf_config(
        hf,
        qk_norm=True,
        layer_kinds=kinds,
        deltanet=deltanet,
        moe=moe,
        shared_expert_intermediate_size=int(getattr(hf, "shared_expert_intermediate_size", 0)),
    )


class GatedAttention(nn.Module):
    """q (with its gate), k, v fused; (1 + w) q/k norms; partial rotary; paged attention; the
    output gated by sigmoid(gate); row-parallel o_proj. q_proj's rows are per head [q, gate],
    so an even split gives each rank whole heads."""

    def __init__(
        self, build: BuildContext, backend: AttentionBackend, rotary: Rotation, prefix: str
    ) -> None:
        super().__init__()
        config, parallel = build.config, build.parallel
        tp, rank, d = parallel.tp_size, parallel.tp_rank, config.head_dim
        if config.num_heads % tp:
            raise ValueError(
                f"attention heads ({config.num_heads}) are not divisible by "
                f"tensor_parallel_size {tp}"
            )
        self.num_heads = config.num_heads // tp
        self.num_kv_heads = kv_heads_per_rank(config.num_kv_heads, tp)
        self.head_dim = d
        q_rows, kv_rows = self.num_heads * 2 * d, self.num_kv_heads * d
        kv_start = first_kv_head(config.num_kv_heads, tp, rank) * d
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size,
            [config.num_heads * 2 * d, config.num_kv_heads * d, config.num_kv_heads * d],
            bias=False,
            shards=[(rank * q_rows, q_rows), (kv_start, kv_rows), (kv_start, kv_rows)],
            **build.linear_args(join_prefix(prefix, "qkv_proj")),
        )
        self.o_proj = RowParallelLinear(
            config.num_heads * d,
            config.hidden_size,
            bias=False,
            **build.linear_args(join_prefix(prefix, "o_proj")),
        )
        eps, dtype, device = config.rms_norm_eps, build.dtype, build.device
        self.q_norm = GemmaRMSNorm(d, eps, dtype=dtype, device=device)
        self.k_norm = GemmaRMSNorm(d, eps, dtype=dtype, device=device)
        self.backend = backend
        self.rotary = rotary

    def forward(self, hidden: torch.Tensor, ctx: StepContext, kv_cache: LayerCache) -> torch.Tensor:
        assert isinstance(kv_cache, torch.Tensor)
        tokens, h, kvh, d = hidden.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(hidden)
        query_gate = qkv[:, : h * 2 * d].view(tokens, h, 2 * d)
        key = qkv[:, h * 2 * d : (h * 2 + kvh) * d].view(tokens, kvh, d)
        value = qkv[:, (h * 2 + kvh) * d :].view(tokens, kvh, d)
        query = self.rotary.rotate(self.q_norm(query_gate[..., :d]), ctx.cos, ctx.sin)
        key = self.rotary.rotate(self.k_norm(key), ctx.cos, ctx.sin)
        out = self.backend.forward(query, key, value.contiguous(), kv_cache, ctx.attn_metadata)
        gate = query_gate[..., d:].reshape(tokens, h * d)
        return self.o_proj(out.reshape(tokens, h * d) * torch.sigmoid(gate))


class SharedExpertMoe(nn.Module):
    """Routed experts plus a shared expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, build: BuildContext, prefix: str) -> None:
        super().__init__()
        config = build.config
        assert isinstance(config, Qwen3NextConfig)
        parallel, dtype, device = build.parallel, build.dtype, build.device
        self.moe, self.parallel = config.moe, parallel
        self.gate = MoeRouter(
            config.hidden_size, config.moe.num_experts, dtype=dtype, device=device
        )
        self.experts = FusedExperts(
            config.hidden_size, config.moe, parallel=parallel, dtype=dtype, device=device
        )
        shared_config = dataclasses.replace(
            config, intermediate_size=config.shared_expert_intermediate_size
        )
        self.shared_expert = LlamaMLP(
            dataclasses.replace(build, config=shared_config), join_prefix(prefix, "shared_expert")
        )
        self.shared_expert_gate = MoeRouter(config.hidden_size, 1, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.moe.top_k, self.moe.renormalize)
        out = self.experts(x, weights, ids)
        if self.parallel.tp_size > 1:
            out = self.parallel.all_reduce(out)
        shared = self.shared_expert(x) * torch.sigmoid(self.shared_expert_gate(x))
        return out.to(x.dtype) + shared


class Qwen3NextDecoderLayer(nn.Module):
    """Pre-norm token mixer (gated DeltaNet or gated attention) and MLP, (1 + w) norms; the
    residual add is fused into the next norm."""

    def __init__(
        self,
        build: BuildContext,
        layer: int,
        backend: AttentionBackend,
        rotary: Rotation,
        prefix: str,
    ) -> None:
        super().__init__()
        config = build.config
        assert isinstance(config, Qwen3NextConfig)
        self.is_linear = config.layer_kinds[layer] == LINEAR_ATTENTION
        self.linear_attn: GatedDeltaNet | None = None
        self.self_attn: GatedAttention | None = None
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(
                config.deltanet, **build.linear_args(join_prefix(prefix, "linear_attn"))
            )
        else:
            self.self_attn = GatedAttention(
                build, backend, rotary, join_prefix(prefix, "self_attn")
            )
        mlp_prefix = join_prefix(prefix, "mlp")
        sparse = config.moe.sparse_layers[layer]
        self.mlp = SharedExpertMoe(build, mlp_prefix) if sparse else LlamaMLP(build, mlp_prefix)
        size, eps, dtype, device = (
            config.hidden_size,
            config.rms_norm_eps,
            build.dtype,
            build.device,
        )
        self.input_layernorm = GemmaRMSNorm(size, eps, dtype=dtype, device=device)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, dtype=dtype, device=device)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: StepContext,
        cache: LayerCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        if self.linear_attn is not None:
            hidden = self.linear_attn(hidden, ctx, cache)
        else:
            assert self.self_attn is not None
            hidden = self.self_attn(hidden, ctx, cache)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3NextForCausalLM(DecoderForCausalLM):
    """One pipeline stage of Qwen3-Next, sharded over the TP group."""

    is_hybrid: ClassVar[Literal[True]] = True

    @classmethod
    def read_config(cls, hf: Any) -> ModelConfig:
        return read_qwen3_next_config(hf)

    def make_layer(
        self, build: BuildContext, layer: int, backend: AttentionBackend, prefix: str
    ) -> nn.Module:
        return Qwen3NextDecoderLayer(build, layer, backend, self.rotary, prefix)

    def make_norm(self, build: BuildContext) -> ResidualNorm:
        config = build.config
        return GemmaRMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype=build.dtype, device=build.device
        )

    @property
    def state_specs(self) -> Sequence[StateSpec | None]:
        """Per layer of this stage: a DeltaNet layer's state, None for a full-attention one."""
        specs: list[StateSpec | None] = []
        for layer in self.layers:
            assert isinstance(layer, Qwen3NextDecoderLayer)
            specs.append(None if layer.linear_attn is None else layer.linear_attn.state_spec())
        return specs

    def resolve_weight_name(self, name: str) -> list[WeightTarget]:
        if name.startswith("mtp."):
            return []
        if match := _LINEAR_ATTN.match(name):
            if match.group(2) not in CHECKPOINT_TENSORS:
                raise ValueError(f"checkpoint tensor {name!r} has no place in Qwen3-Next")
            module, param, part = CHECKPOINT_TENSORS[match.group(2)]
            path = "linear_attn" + (f".{module}" if module else "")
            return [WeightTarget(int(match.group(1)), path, param, part)]
        if match := _EXPERT.match(name):
            return [expert_target(int(match.group(1)), int(match.group(2)), match.group(3))]
        if match := _MLP_MODULE.match(name):
            return [WeightTarget(int(match.group(1)), f"mlp.{match.group(2)}", "weight")]
        if match := _SHARED.match(name):
            layer, projection = int(match.group(1)), match.group(2)
            if projection == "down":
                return [WeightTarget(layer, "mlp.shared_expert.down_proj", "weight")]
            part = int(projection == "up")
            return [WeightTarget(layer, "mlp.shared_expert.gate_up_proj", "weight", part)]
        return super().resolve_weight_name(name)

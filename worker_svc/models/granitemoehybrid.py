"""IBM Granite 4.0-H (`GraniteMoeHybridForCausalLM`): Mamba2 layers beside attention layers.

As transformers' GraniteMoeHybrid code computes it: each decoder layer mixes with a Mamba2
mixer (layers/mamba2.py) or Granite's attention (scores scaled by `attention_multiplier`, rope
only when `position_embedding_type` is "rope", else none), then runs its MLP: a sparse MoE (a
softmax over the router's top-k logits) plus a shared SiLU-gated MLP, or the shared MLP alone
when `num_local_experts` is 0. Both block outputs are multiplied by `residual_multiplier`;
embeddings by `embedding_multiplier`; logits divided by `logits_scaling`.

Checkpoint names (what transformers 5.24 saves): `mamba.{in_proj, conv1d, A_log, D, dt_bias,
norm, out_proj}`; `block_sparse_moe.router.layer.weight` [E, H]; `block_sparse_moe.input_linear
.weight` [E, 2I, H] (each expert's gate rows, then its up rows) and `output_linear.weight`
[E, H, I]; `shared_mlp.input_linear.weight` [2S, H] (gate, up) and `output_linear.weight`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from worker_svc.attention.backend import AttentionBackend
from worker_svc.layers.activation import ACTIVATIONS
from worker_svc.layers.linear import ColumnParallelLinear, RowParallelLinear
from worker_svc.layers.mamba2 import Mamba2Config, Mamba2Mixer, mixer_targets
from worker_svc.layers.moe import MoeConfig, SparseMoeBlock
from worker_svc.layers.rmsnorm import RMSNorm
from worker_svc.layers.rotary import NoPositionEmbedding, Rotation
from worker_svc.layers.state_cache import LayerCache, StateSpec
from worker_svc.layers.tensor_source import TensorSource
from worker_svc.models.decoder import BuildContext, StepContext, join_prefix
from worker_svc.models.granite import GraniteConfig, GraniteForCausalLM
from worker_svc.models.llama import LlamaAttention
from worker_svc.models.mixtral import expert_target
from worker_svc.models.model_config import ModelConfig
from worker_svc.models.weight_names import WeightTarget, fused_targets

MAMBA, ATTENTION = "mamba", "attention"
_BLOCK_TYPES = {
    "mamba": MAMBA,
    "linear_attention": MAMBA,
    "attention": ATTENTION,
    "full_attention": ATTENTION,
}
"""config.json's layer types (transformers 5's names and Granite 4.0-H's own) -> ours."""

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(mamba|shared_mlp|block_sparse_moe)\.(.+)$")
_EXPERT = re.compile(r"experts\.(\d+)\.(gate|up|down)")
"""The per-expert names `split_experts` gives the stacked expert tensors' parts."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GraniteMoeHybridConfig(GraniteConfig):
    """Granite's multipliers, each layer's block type, its Mamba2 mixers and its MLPs."""

    block_types: tuple[str, ...]
    mamba: Mamba2Config
    moe: MoeConfig | None
    shared_intermediate_size: int
    use_rope: bool


def read_mamba2_config(hf: Any) -> Mamba2Config:
    """The Mamba2 mixers' shape from config.json's mamba_* fields."""
    if int(hf.mamba_d_conv) < 2:
        raise ValueError(f"mamba_d_conv {hf.mamba_d_conv} is not supported (at least 2)")
    limit = tuple(float(v) for v in (getattr(hf, "time_step_limit", None) or (0.0, math.inf)))
    if len(limit) != 2:
        raise ValueError(f"time_step_limit {limit} is not a (min, max) pair")
    return Mamba2Config(
        hidden_size=int(hf.hidden_size),
        num_heads=int(hf.mamba_n_heads),
        head_dim=int(hf.mamba_d_head),
        state_size=int(hf.mamba_d_state),
        num_groups=int(hf.mamba_n_groups),
        conv_kernel=int(hf.mamba_d_conv),
        chunk_size=int(hf.mamba_chunk_size),
        rms_norm_eps=float(hf.rms_norm_eps),
        conv_bias=bool(hf.mamba_conv_bias),
        proj_bias=bool(hf.mamba_proj_bias),
        time_step_limit=(limit[0], limit[1]),
    )


def read_block_types(hf: Any) -> tuple[str, ...]:
    declared = list(getattr(hf, "layer_types", None) or [])
    if len(declared) != int(hf.num_hidden_layers):
        raise ValueError("config.json's layer_types must name every layer's block type")
    unknown = sorted({str(t) for t in declared} - set(_BLOCK_TYPES))
    if unknown:
        raise ValueError(f"GraniteMoeHybrid layer types {unknown} are not supported")
    return tuple(_BLOCK_TYPES[str(t)] for t in declared)


class SharedMLP(nn.Module):
    """output_linear(silu(gate) * up), gate and up the halves of input_linear."""

    def __init__(self, build: BuildContext, size: int, prefix: str) -> None:
        super().__init__()
        hidden = build.config.hidden_size
        self.gate_up_proj = ColumnParallelLinear(
            hidden,
            [size, size],
            bias=False,
            **build.linear_args(join_prefix(prefix, "gate_up_proj")),
        )
        self.act_fn = ACTIVATIONS["silu"]()
        self.down_proj = RowParallelLinear(
            size, hidden, bias=False, **build.linear_args(join_prefix(prefix, "down_proj"))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GraniteMoeHybridDecoderLayer(nn.Module):
    """A Mamba2 mixer or attention, then the MoE plus shared MLP; outputs residual-scaled."""

    def __init__(
        self, build: BuildContext, layer: int, backend: AttentionBackend, rotary: Rotation,
        prefix: str,
    ) -> None:  # fmt: skip
        super().__init__()
        config = build.config
        assert isinstance(config, GraniteMoeHybridConfig)
        dtype, device, eps = build.dtype, build.device, config.rms_norm_eps
        self.residual_multiplier = config.residual_multiplier
        self.mamba: Mamba2Mixer | None = None
        self.self_attn: LlamaAttention | None = None
        if config.block_types[layer] == MAMBA:
            args = build.linear_args(join_prefix(prefix, "mamba"))
            self.mamba = Mamba2Mixer(config.mamba, args)
        else:
            self.self_attn = LlamaAttention(
                build, backend, rotary, join_prefix(prefix, "self_attn")
            )
        self.mlp: SparseMoeBlock | None = None  # the checkpoint's block_sparse_moe
        if config.moe is not None:
            self.mlp = SparseMoeBlock(
                config.hidden_size, config.moe, parallel=build.parallel, dtype=dtype, device=device
            )
        shared = config.shared_intermediate_size
        self.shared_mlp = SharedMLP(build, shared, join_prefix(prefix, "shared_mlp"))
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: StepContext,
        cache: LayerCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        if self.mamba is not None:
            assert ctx.state is not None and isinstance(cache, tuple)
            hidden = self.mamba(hidden, ctx.state, cache)
        else:
            assert self.self_attn is not None and isinstance(cache, torch.Tensor)
            hidden = self.self_attn(hidden, ctx, cache)
        hidden, residual = self.post_attention_layernorm.add_and_norm(
            hidden * self.residual_multiplier, residual
        )
        out = self.shared_mlp(hidden)
        if self.mlp is not None:
            out = out + self.mlp(hidden)
        return out * self.residual_multiplier, residual


class ExpertRows:
    """Rows [start, start + num_rows) of expert `expert` of a [E, rows, cols] checkpoint tensor,
    as a 2-D `TensorSource` (read lazily)."""

    def __init__(self, source: TensorSource, expert: int, start: int, num_rows: int) -> None:
        self.source, self.expert, self.start, self.num_rows = source, expert, start, num_rows

    def get_shape(self) -> list[int]:
        return [self.num_rows, *self.source.get_shape()[2:]]

    def __getitem__(self, index: slice | tuple[slice, ...]) -> torch.Tensor:
        rows, rest = (index[0], index[1:]) if isinstance(index, tuple) else (index, ())
        first, last, step = rows.indices(self.num_rows)
        if step != 1:
            raise ValueError("ExpertRows reads contiguous rows only")
        rows = slice(self.start + first, self.start + last)
        return self.source[(slice(self.expert, self.expert + 1), rows, *rest)][0]


class GraniteMoeHybridForCausalLM(GraniteForCausalLM):
    """One pipeline stage of a Granite 4.0-H model."""

    is_hybrid: ClassVar[Literal[True]] = True
    config: GraniteMoeHybridConfig

    @classmethod
    def read_config(cls, hf: Any) -> ModelConfig:
        position = getattr(hf, "position_embedding_type", None)
        if position not in (None, "rope"):
            raise ValueError(f"position_embedding_type {position!r} is not supported")
        num_experts = int(getattr(hf, "num_local_experts", 0) or 0)
        moe = None
        if num_experts:
            moe = MoeConfig(
                num_experts=num_experts,
                top_k=int(hf.num_experts_per_tok),
                intermediate_size=int(hf.intermediate_size),
                renormalize=True,  # a softmax over the top-k logits
                sparse_layers=(True,) * int(hf.num_hidden_layers),
            )
        return GraniteMoeHybridConfig.from_hf_config(
            hf,
            embedding_multiplier=float(hf.embedding_multiplier),
            residual_multiplier=float(hf.residual_multiplier),
            attention_multiplier=float(hf.attention_multiplier),
            logits_scaling=float(hf.logits_scaling),
            layer_types=(),
            block_types=read_block_types(hf),
            mamba=read_mamba2_config(hf),
            moe=moe,
            shared_intermediate_size=int(hf.shared_intermediate_size),
            use_rope=position == "rope",
        )

    def make_layer(
        self, build: BuildContext, layer: int, backend: AttentionBackend, prefix: str
    ) -> nn.Module:
        rotary: Rotation = self.rotary if self.config.use_rope else NoPositionEmbedding()
        return GraniteMoeHybridDecoderLayer(build, layer, backend, rotary, prefix)

    @property
    def state_specs(self) -> Sequence[StateSpec | None]:
        return [
            None if layer.mamba is None else layer.mamba.state_spec()
            for layer in self.layers
            if isinstance(layer, GraniteMoeHybridDecoderLayer)
        ]

    def resolve_weight_name(self, name: str) -> list[WeightTarget]:
        match = _LAYER.match(name)
        if match is None:
            return super().resolve_weight_name(name)
        layer, block, rest = int(match.group(1)), match.group(2), match.group(3)
        if block == "mamba":
            return [
                WeightTarget(layer, f"mamba.{module}", param, part, rows)
                for module, param, part, rows in mixer_targets(self.config.mamba, rest)
            ]
        if block == "shared_mlp" and rest == "input_linear.weight":
            size = self.config.shared_intermediate_size
            return fused_targets(layer, "shared_mlp.gate_up_proj", [size, size])
        if block == "shared_mlp" and rest == "output_linear.weight":
            return [WeightTarget(layer, "shared_mlp.down_proj", "weight")]
        if block == "block_sparse_moe" and rest == "router.layer.weight":
            return [WeightTarget(layer, "mlp.gate", "weight")]
        if block == "block_sparse_moe" and (expert := _EXPERT.fullmatch(rest)):
            return [expert_target(layer, int(expert.group(1)), expert.group(2))]
        raise ValueError(f"checkpoint tensor {name!r} has no place in a GraniteMoeHybrid model")

    def load_weights(self, weights: Iterable[tuple[str, TensorSource]]) -> None:
        super().load_weights(self.split_experts(weights))

    def split_experts(
        self, weights: Iterable[tuple[str, TensorSource]]
    ) -> Iterator[tuple[str, TensorSource]]:
        """The experts' stacked tensors as one (name, source) per expert and projection
        (`...block_sparse_moe.experts.{e}.gate|up|down`), read lazily."""
        for name, source in weights:
            prefix, _, rest = name.rpartition(".block_sparse_moe.")
            if rest not in ("input_linear.weight", "output_linear.weight"):
                yield name, source
                continue
            num_experts, rows = source.get_shape()[0], source.get_shape()[1]
            for e in range(num_experts):
                base = f"{prefix}.block_sparse_moe.experts.{e}"
                if rest == "output_linear.weight":
                    yield f"{base}.down", ExpertRows(source, e, 0, rows)
                else:
                    yield f"{base}.gate", ExpertRows(source, e, 0, rows // 2)
                    yield f"{base}.up", ExpertRows(source, e, rows // 2, rows // 2)

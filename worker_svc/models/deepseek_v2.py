"""DeepSeek-V2 and -V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`): multi-head latent
attention (MLA) over a latent KV cache, and mixtures of routed plus shared experts.

MLA, as transformers' DeepseekV2/V3 code computes it: queries from `q_proj`, or through a low
rank (`q_a_proj`, `q_a_layernorm`, `q_b_proj`) when `q_lora_rank` is set; each head's query is
a nope part and a rope part (qk_nope_head_dim + qk_rope_head_dim). Keys and values come from
one latent per token: `kv_a_proj_with_mqa` gives the kv_lora_rank latent (normalised by
`kv_a_layernorm`) and a rope key shared by every head; `kv_b_proj` up-projects the latent to
each head's nope key and value. The softmax scale is qk_head_dim ** -0.5 times yarn's mscale
squared (`mscale_all_dim`). Here the cache holds the latent and the rotated rope key, 576 values
a token for V3, and attention runs in the latent space (vLLM's MLA, "absorbed"): each head's
nope query times its key up-projection meets the latents directly, the output latent times the
head's value up-projection is its value (attention/mla_backend.py). V2's rope turns adjacent
pairs; V3's too with `rope_interleave` (transformers then writes the rotated pairs de-interleaved,
the same dot products).

Experts: the first `first_k_dense_replace` layers are dense; the others route each token to
`num_experts_per_tok` of `n_routed_experts` experts plus `n_shared_experts` always on (one MLP
of that many times moe_intermediate_size). V2: softmax scores, the top-k (`greedy`) or the
top-k within the `topk_group` groups of highest score (`group_limited_greedy`), times
routed_scaling_factor. V3: sigmoid scores, groups ranked by their two best scores plus the
`e_score_correction_bias`, the top-k of the best groups by biased score weighted by their
unbiased scores, normalised (`norm_topk_prob`), times routed_scaling_factor.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from worker_svc.attention.backend import AttentionBackend, AttentionOptions
from worker_svc.layers.linear import ColumnParallelLinear, RowParallelLinear
from worker_svc.layers.moe import FusedExperts, MoeConfig, MoeRouter
from worker_svc.layers.rmsnorm import RMSNorm
from worker_svc.layers.rotary import Rotation, yarn_mscale
from worker_svc.layers.tensor_source import TensorSource, copy_checked
from worker_svc.models.decoder import BuildContext, DecoderForCausalLM, StepContext, join_prefix
from worker_svc.models.deepseek_routing import RoutingConfig, route_deepseek
from worker_svc.models.llama import LlamaDecoderLayer, LlamaMLP
from worker_svc.models.mixtral import expert_target
from worker_svc.models.model_config import ModelConfig, architecture_of
from worker_svc.models.weight_names import WeightTarget

_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_GATE = re.compile(r"^model\.layers\.(\d+)\.mlp\.gate\.(weight|e_score_correction_bias)$")
_ATTN = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(\w+)\.weight$")
_SHARED = re.compile(r"^model\.layers\.(\d+)\.mlp\.shared_experts\.(gate|up|down)_proj\.weight$")
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
_LATENT_NORM_EPS = 1e-6
"""transformers' q_a_layernorm and kv_a_layernorm keep their class's default eps."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MlaConfig(ModelConfig):
    """MLA's ranks and head parts, the experts and their routing."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float
    moe: MoeConfig
    routing: RoutingConfig
    shared_intermediate_size: int

    def layer_attention(self, layer: int) -> AttentionOptions:
        return AttentionOptions(scale=self.softmax_scale)


def read_mla_config(hf: Any) -> MlaConfig:
    """The checkpoint's MLA and experts; the cached head is the latent plus the rope key."""
    refuse_unserved(hf)
    nope, rope_dim, lora = int(hf.qk_nope_head_dim), int(hf.qk_rope_head_dim), int(hf.kv_lora_rank)
    num_layers, dense = int(hf.num_hidden_layers), int(hf.first_k_dense_replace or 0)
    base = ModelConfig.from_hf_config(hf)
    interleaved = architecture_of(hf) == "DeepseekV2ForCausalLM" or bool(
        getattr(hf, "rope_interleave", True)
    )
    moe = MoeConfig(
        num_experts=int(hf.n_routed_experts),
        top_k=int(hf.num_experts_per_tok),
        intermediate_size=int(hf.moe_intermediate_size),
        renormalize=False,
        sparse_layers=tuple(i >= dense for i in range(num_layers)),
    )
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(ModelConfig)}
    fields |= {"num_kv_heads": 1, "head_dim": lora + rope_dim, "rope_head_dim": rope_dim}
    fields |= {"kv_value_dim": lora, "rope": replace(base.rope, is_neox_style=not interleaved)}
    return MlaConfig(
        **fields,
        q_lora_rank=None if hf.q_lora_rank is None else int(hf.q_lora_rank),
        kv_lora_rank=lora,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=int(hf.v_head_dim),
        softmax_scale=softmax_scale(hf, nope + rope_dim),
        moe=moe,
        routing=RoutingConfig.read(hf),
        shared_intermediate_size=int(hf.moe_intermediate_size) * int(hf.n_shared_experts or 0),
    )


def softmax_scale(hf: Any, qk_head_dim: int) -> float:
    """qk_head_dim ** -0.5, times yarn's mscale(factor, mscale_all_dim) squared."""
    scale = qk_head_dim**-0.5
    params = dict(getattr(hf, "rope_parameters", None) or {})
    all_dim = params.get("mscale_all_dim") or 0
    if params.get("rope_type", "default") != "default" and all_dim:
        scale *= yarn_mscale(float(params.get("factor", 1.0)), float(all_dim)) ** 2
    return scale


def refuse_unserved(hf: Any) -> None:
    """Config features that would change the math and are not built, refused by name."""
    freq = getattr(hf, "moe_layer_freq", None)
    if freq not in (None, 1):
        raise ValueError(f"moe_layer_freq {freq} is not supported (transformers ignores it)")
    if getattr(hf, "attention_bias", False):
        raise ValueError("attention_bias in a DeepSeek MLA checkpoint is not supported")
    if not getattr(hf, "n_shared_experts", 0):
        raise ValueError("a DeepSeek MoE checkpoint without shared experts is not supported")


class LatentProjection(nn.Module):
    """This rank's heads' rows of `kv_b_proj` [heads * (nope + v), kv_lora_rank], as the
    per-head key and value up-projections the latent attention multiplies by, kept in float32
    (the latent attention's dtype: mla_backend.py)."""

    def __init__(self, config: MlaConfig, build: BuildContext) -> None:
        super().__init__()
        self.num_heads = config.num_heads // build.parallel.tp_size
        self.first_head = build.parallel.tp_rank * self.num_heads
        self.nope, self.v_dim = config.qk_nope_head_dim, config.v_head_dim
        shape = (self.num_heads, config.kv_lora_rank)
        args: dict[str, Any] = {"dtype": torch.float32, "device": build.device}
        self.key_up = nn.Parameter(torch.empty(shape[0], self.nope, shape[1], **args), False)
        """[heads, nope, kv_lora_rank]"""
        self.value_up = nn.Parameter(torch.empty(shape[0], self.v_dim, shape[1], **args), False)
        """[heads, v_head_dim, kv_lora_rank]"""

    def load(self, param_name: str, source: TensorSource, part: int = 0) -> None:
        """`key_up` or `value_up` from this rank's heads' rows of the checkpoint's kv_b_proj."""
        per_head = self.nope + self.v_dim
        start = self.first_head * per_head
        rows = source[start : start + self.num_heads * per_head].float()
        rows = rows.view(self.num_heads, per_head, -1)
        if param_name == "key_up":
            copy_checked(self.key_up, rows[:, : self.nope], param_name)
        elif param_name == "value_up":
            copy_checked(self.value_up, rows[:, self.nope :], param_name)
        else:
            raise ValueError(f"kv_b_proj has no {param_name!r}")


class MlaAttention(nn.Module):
    """Multi-head latent attention over the latent cache, in the latent space."""

    def __init__(
        self, build: BuildContext, backend: AttentionBackend, rotary: Rotation, prefix: str
    ) -> None:
        super().__init__()
        config = build.config
        assert isinstance(config, MlaConfig)
        self.config, self.backend, self.rotary = config, backend, rotary
        self.num_heads = config.num_heads // build.parallel.tp_size
        hidden, lora, rope_dim = config.hidden_size, config.kv_lora_rank, config.qk_rope_head_dim
        qk_dim = config.qk_nope_head_dim + rope_dim
        norm: dict[str, Any] = {"dtype": build.dtype, "device": build.device}

        def linear(name: str, inputs: int, outputs: int, replicated: bool) -> ColumnParallelLinear:
            shards = [(0, outputs)] if replicated else None
            args = build.linear_args(join_prefix(prefix, name))
            return ColumnParallelLinear(inputs, [outputs], bias=False, shards=shards, **args)

        heads = config.num_heads
        if config.q_lora_rank is None:
            self.q_proj = linear("q_proj", hidden, heads * qk_dim, replicated=False)
        else:
            rank = config.q_lora_rank
            self.q_a_proj = linear("q_a_proj", hidden, rank, replicated=True)
            self.q_a_layernorm = RMSNorm(rank, _LATENT_NORM_EPS, **norm)
            self.q_b_proj = linear("q_b_proj", rank, heads * qk_dim, replicated=False)
        self.kv_a_proj_with_mqa = linear("kv_a_proj_with_mqa", hidden, lora + rope_dim, True)
        self.kv_a_layernorm = RMSNorm(lora, _LATENT_NORM_EPS, **norm)
        self.kv_b_proj = LatentProjection(config, build)
        self.o_proj = RowParallelLinear(
            heads * config.v_head_dim,
            hidden,
            bias=False,
            **build.linear_args(join_prefix(prefix, "o_proj")),
        )

    def forward(
        self, hidden: torch.Tensor, ctx: StepContext, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        config, h, num_tokens = self.config, self.num_heads, hidden.shape[0]
        lora, nope = config.kv_lora_rank, config.qk_nope_head_dim
        if config.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(num_tokens, h, -1)
        latent = self.kv_a_proj_with_mqa(hidden)
        key = torch.cat(
            (
                self.kv_a_layernorm(latent[:, :lora].contiguous()),
                self.rotary.rotate(latent[:, None, lora:], ctx.cos, ctx.sin)[:, 0],
            ),
            dim=-1,
        )
        key = key.float().unsqueeze(1)  # the latent attention runs in float32
        q_pe = self.rotary.rotate(q[..., nope:], ctx.cos, ctx.sin).float()
        q_latent = torch.einsum("thn,hnc->thc", q[..., :nope].float(), self.kv_b_proj.key_up)
        query = torch.cat((q_latent, q_pe), dim=-1)
        out = self.backend.forward(query, key, key[..., :lora], kv_cache, ctx.attn_metadata)
        values = torch.einsum("thc,hvc->thv", out, self.kv_b_proj.value_up)
        return self.o_proj(values.to(hidden.dtype).reshape(num_tokens, h * config.v_head_dim))


class DeepseekMoeBlock(nn.Module):
    """Routed experts (layers/moe.py's grouped experts) plus the shared experts' MLP."""

    def __init__(self, build: BuildContext, prefix: str) -> None:
        super().__init__()
        config = build.config
        assert isinstance(config, MlaConfig)
        self.routing, self.parallel = config.routing, build.parallel
        dtype, device = build.dtype, build.device
        self.gate = DeepseekRouter(config, dtype=dtype, device=device)
        self.experts = FusedExperts(
            config.hidden_size, config.moe, parallel=build.parallel, dtype=dtype, device=device
        )
        shared = replace(config, intermediate_size=config.shared_intermediate_size)
        self.shared_experts = LlamaMLP(
            dataclasses.replace(build, config=shared), join_prefix(prefix, "shared_experts")
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x.float())
        weights, ids = route_deepseek(logits, self.gate.e_score_correction_bias, self.routing)
        routed = self.experts(x, weights.to(x.dtype), ids)
        routed = routed if self.parallel.tp_size == 1 else self.parallel.all_reduce(routed)
        return routed + self.shared_experts(x)


class DeepseekRouter(MoeRouter):
    """The router in float32 (transformers' casts), with V3's score-correction bias."""

    def __init__(self, config: MlaConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        num_experts = config.moe.num_experts
        super().__init__(config.hidden_size, num_experts, dtype=torch.float32, device=device)
        self.e_score_correction_bias: nn.Parameter | None = None
        if config.routing.scoring == "sigmoid":
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(num_experts, dtype=torch.float32, device=device), False
            )

    def load(self, param_name: str, source: TensorSource, part: int = 0) -> None:
        if param_name == "e_score_correction_bias" and self.e_score_correction_bias is not None:
            copy_checked(self.e_score_correction_bias, source[:].float(), param_name)
            return
        copy_checked(self.weight, source[:].float(), param_name)


class DeepseekV2ForCausalLM(DecoderForCausalLM):
    """One pipeline stage of a DeepSeek-V2 or -V3 model."""

    config: MlaConfig

    @classmethod
    def read_config(cls, hf: Any) -> ModelConfig:
        return read_mla_config(hf)

    def make_layer(
        self, build: BuildContext, layer: int, backend: AttentionBackend, prefix: str
    ) -> nn.Module:
        assert isinstance(build.config, MlaConfig)
        attention = MlaAttention(build, backend, self.rotary, join_prefix(prefix, "self_attn"))
        mlp = None
        if build.config.moe.sparse_layers[layer]:
            mlp = DeepseekMoeBlock(build, join_prefix(prefix, "mlp"))
        return LlamaDecoderLayer(build, backend, self.rotary, prefix, mlp=mlp, attention=attention)

    def resolve_weight_name(self, name: str) -> list[WeightTarget]:
        if (match := _LAYER_INDEX.match(name)) and int(match.group(1)) >= self.config.num_layers:
            return []  # V3's multi-token-prediction layer (a draft head, not served)
        if match := _EXPERT.match(name):
            return [expert_target(int(match.group(1)), int(match.group(2)), match.group(3))]
        if match := _GATE.match(name):
            return [WeightTarget(int(match.group(1)), "mlp.gate", match.group(2))]
        if match := _SHARED.match(name):
            layer, projection = int(match.group(1)), match.group(2)
            if projection == "down":
                return [WeightTarget(layer, "mlp.shared_experts.down_proj", "weight")]
            part = 0 if projection == "gate" else 1
            return [WeightTarget(layer, "mlp.shared_experts.gate_up_proj", "weight", part)]
        if (match := _ATTN.match(name)) and match.group(2) == "kv_b_proj":
            layer = int(match.group(1))
            return [
                WeightTarget(layer, "self_attn.kv_b_proj", "key_up"),
                WeightTarget(layer, "self_attn.kv_b_proj", "value_up"),
            ]
        if (match := _ATTN.match(name)) and match.group(2) not in ("o_proj",):
            return [WeightTarget(int(match.group(1)), f"self_attn.{match.group(2)}", "weight")]
        return super().resolve_weight_name(name)

"""Where each Hugging Face Llama-family checkpoint tensor goes in our fused modules."""

from __future__ import annotations

import re
from dataclasses import dataclass

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")

PACKED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
"""Our fused layers and the checkpoint projections each holds, in order (the decoders'
`packed_modules_mapping`)."""

# HF sub-module -> (our sub-module, fused part)
_LAYER_MODULES: dict[str, tuple[str, int]] = {
    **{
        f"self_attn.{p}": ("self_attn.qkv_proj", i)
        for i, p in enumerate(PACKED_MODULES["qkv_proj"])
    },
    **{f"mlp.{p}": ("mlp.gate_up_proj", i) for i, p in enumerate(PACKED_MODULES["gate_up_proj"])},
    "self_attn.o_proj": ("self_attn.o_proj", 0),
    "self_attn.q_norm": ("self_attn.q_norm", 0),
    "self_attn.k_norm": ("self_attn.k_norm", 0),
    "mlp.down_proj": ("mlp.down_proj", 0),
    "input_layernorm": ("input_layernorm", 0),
    "post_attention_layernorm": ("post_attention_layernorm", 0),
    "pre_feedforward_layernorm": ("pre_feedforward_layernorm", 0),  # Gemma 2 / 3
    "post_feedforward_layernorm": ("post_feedforward_layernorm", 0),
}

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_KV_SCALE = re.compile(
    r"^model\.layers\.(\d+)\.self_attn\.(?:(k|v|kv)_scale|([kv])_proj\.output_scale)$"
)
"""A layer's per-tensor KV-cache scales (compressed-tensors' kv_cache_scheme: `self_attn.k_scale`
and `v_scale`; older llm-compressor checkpoints `self_attn.k_proj.output_scale`; AutoFP8's one
`self_attn.kv_scale` for both), for an fp8 KV cache."""


@dataclass(frozen=True, slots=True)
class WeightTarget:
    """A destination: decoder layer (None = a top-level module), sub-module, parameter, part;
    `rows` (first row, number of rows) when the destination takes only part of the tensor (a
    checkpoint that stores q/k/v or gate/up fused, split at load)."""

    layer: int | None
    module: str
    param: str
    part: int = 0
    rows: tuple[int, int] | None = None


def resolve_weight_name(name: str, tie_word_embeddings: bool) -> list[WeightTarget]:
    """Targets of checkpoint tensor `name` (empty for tensors we ignore); ValueError if unknown."""
    if name.endswith(_IGNORED_SUFFIXES):
        return []
    if name == "model.embed_tokens.weight":
        targets = [WeightTarget(None, "embed_tokens", "weight")]
        if tie_word_embeddings:
            targets.append(WeightTarget(None, "lm_head", "weight"))
        return targets
    if name == "model.norm.weight":
        return [WeightTarget(None, "norm", "weight")]
    if name == "lm_head.weight":
        return [WeightTarget(None, "lm_head", "weight")]
    match = _KV_SCALE.match(name)
    if match:
        which = match.group(2) or match.group(3)  # "k", "v" or "kv"
        layer = int(match.group(1))
        return [WeightTarget(layer, "self_attn", f"{part}_scale") for part in which]
    match = _LAYER.match(name)
    if match and match.group(2) in _LAYER_MODULES:
        module, part = _LAYER_MODULES[match.group(2)]
        return [WeightTarget(int(match.group(1)), module, match.group(3), part)]
    raise ValueError(f"checkpoint tensor {name!r} has no place in a Llama-family model")


def fused_targets(layer: int, module: str, sizes: list[int]) -> list[WeightTarget]:
    """The targets of a checkpoint tensor that stores `module`'s parts fused (rows of `sizes`,
    in order), each part loaded from its own rows (Phi-3's qkv_proj, Phi-3's and GLM-4's
    gate_up_proj)."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [
        WeightTarget(layer, module, "weight", part, (start, size))
        for part, (start, size) in enumerate(zip(starts, sizes, strict=True))
    ]

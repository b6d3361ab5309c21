"""Rotary position embedding settings, read from a transformers config's `rope_parameters`.

transformers 5 normalises old `rope_scaling` / `rope_theta` keys into `rope_parameters`; Gemma 3
keeps one entry per layer type (`full_attention`, `sliding_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary position embedding: base, the rotated fraction of each head, optional scaling.

    `factor` scales linear, llama3, yarn and dynamic (NTK); yarn also uses the beta / mscale
    fields, longrope its per-frequency `short_factor` / `long_factor`; both multiply cos and sin
    by an attention factor (`attention_factor`, or derived from `factor`).
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    mrope_section: tuple[int, ...] = ()
    """M-RoPE (Qwen2-VL): how many of the rotated frequencies follow each position row
    (temporal, height, width); empty: one position row (plain rope)."""
    is_neox_style: bool = True
    """Which dimensions rotate together: the two halves of the rotated part (neox, Llama) or
    adjacent pairs (GPT-J style, GLM-4: vLLM's is_neox_style=False); a family sets it."""

    def context_limit(self) -> int:
        """Longest context the scaling is meant for (vLLM's rule): max_position_embeddings
        times `factor` for linear and dynamic, the original length times `factor` for yarn."""
        if self.rope_type in ("linear", "dynamic"):
            return int(self.max_position_embeddings * self.factor)
        if self.rope_type == "yarn":
            scaled = int(self.original_max_position_embeddings * self.factor)
            return max(scaled, self.max_position_embeddings)
        return self.max_position_embeddings


def rope_parameters(hf: Any) -> dict[str, Any]:
    """The config's rope parameters (transformers 5's `rope_parameters`, else `rope_scaling`)."""
    params: dict[str, Any] = dict(getattr(hf, "rope_parameters", None) or {})
    legacy = getattr(hf, "rope_scaling", None)
    if not params and isinstance(legacy, dict):
        params = dict(legacy)
    return params


def rope_config(hf: Any, params: dict[str, Any] | None = None) -> RopeConfig:
    """RopeConfig from `params` (default: the config's own); refuses unknown rope types."""
    if params is None:
        params = rope_parameters(hf)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "mrope":  # transformers 4's name for Qwen2-VL's default-frequency M-RoPE
        rope_type = "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; supported rope types: "
            + ", ".join(SUPPORTED_ROPE_TYPES)
        )
    max_positions = int(hf.max_position_embeddings)
    original = int(params.get("original_max_position_embeddings") or max_positions)
    factor = params.get("factor")
    if factor is None:
        factor = max_positions / original if rope_type in ("yarn", "longrope") else 1.0
    return RopeConfig(
        theta=float(params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))),
        rope_type=rope_type,
        factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        partial_rotary_factor=float(
            params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0) or 1.0)
        ),
        max_position_embeddings=max_positions,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=_optional_float(params.get("attention_factor")),
        mscale=_optional_float(params.get("mscale")),
        mscale_all_dim=_optional_float(params.get("mscale_all_dim")),
        truncate=bool(params.get("truncate", True)),
        short_factor=tuple(float(f) for f in params.get("short_factor") or ()),
        long_factor=tuple(float(f) for f in params.get("long_factor") or ()),
        mrope_section=tuple(int(n) for n in params.get("mrope_section") or ()),
    )


def layer_type_rope_configs(hf: Any) -> tuple[RopeConfig, RopeConfig | None]:
    """(rope of full-attention layers, rope of sliding-window layers when it differs): Gemma 3
    gives each layer type its own entry; other configs one for all layers."""
    params = rope_parameters(hf)
    if "full_attention" in params or "sliding_attention" in params:
        full = rope_config(hf, dict(params.get("full_attention") or {}))
        local = params.get("sliding_attention")
        return full, rope_config(hf, dict(local)) if local else None
    return rope_config(hf, params), None


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)

"""The facts of a Llama-family checkpoint that our model code needs, read from config.json.

transformers' configuration classes parse the file (that also normalises old `rope_scaling` /
`rope_theta` keys into transformers 5's `rope_parameters`); no transformers modelling code is
used.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from worker_svc.models.vision_config import LlavaVisionConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_ACTIVATIONS = ("silu",)
# Checkpoints serve as stored (bfloat16/float16/float32); GGUF files are dequantized at load.
# No `quantization_config` method is served: its weights would be read as if unquantized.
SUPPORTED_QUANTIZATION_METHODS: tuple[str, ...] = ()

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(name: str) -> torch.dtype:
    """Map a dtype name ("bfloat16", "float16", "float32") to torch; raise ValueError otherwise."""
    try:
        return _DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(
            f"unsupported dtype {name!r}; use auto, bfloat16, float16 or float32"
        ) from None


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary position embedding: base and optional scaling (linear or llama3)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and flavour of a decoder-only Llama-family model.

    Qwen2 sets `qkv_bias`; Qwen3 sets `qk_norm` and an explicit `head_dim`; Llama's
    `attention_bias` also biases `o_proj`.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    checkpoint_dtype: torch.dtype | None = None
    sliding_window: int | None = None
    vision: LlavaVisionConfig | None = None
    """A LLaVA model's vision tower and projector (models/llava.py); None for text-only."""

    @classmethod
    def from_pretrained(cls, model_path: str | Path) -> ModelConfig:
        return cls.from_hf_config(read_hf_config(model_path))

    @classmethod
    def from_hf_config(cls, hf: Any) -> ModelConfig:
        arch = architecture_of(hf)
        _refuse_quantization(hf)
        act = getattr(hf, "hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"hidden_act {act!r} is not supported; supported activations: "
                + ", ".join(SUPPORTED_ACTIVATIONS)
            )
        num_heads = int(hf.num_attention_heads)
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        is_qwen2 = arch.startswith("Qwen2")
        attention_bias = bool(getattr(hf, "attention_bias", False))
        use_sliding = getattr(hf, "use_sliding_window", True)
        return cls(
            architecture=arch,
            vocab_size=int(hf.vocab_size),
            hidden_size=int(hf.hidden_size),
            intermediate_size=int(hf.intermediate_size),
            num_layers=int(hf.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=int(getattr(hf, "num_key_value_heads", None) or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.rms_norm_eps),
            max_position_embeddings=int(hf.max_position_embeddings),
            rope=_rope_config(hf),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=arch.startswith("Qwen3"),
            checkpoint_dtype=_checkpoint_dtype(hf),
            sliding_window=getattr(hf, "sliding_window", None) if use_sliding else None,
        )


def read_hf_config(model_path: str | Path) -> Any:
    """transformers' configuration object of a local checkpoint folder."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_path), local_files_only=True)


def architecture_of(hf: Any) -> str:
    architectures = list(getattr(hf, "architectures", None) or [])
    if not architectures:
        raise ValueError("config.json names no architecture ('architectures' is empty)")
    return str(architectures[0])


def _refuse_quantization(hf: Any) -> None:
    """A quantized checkpoint must never be served as if its weights were plain floats."""
    quantization = getattr(hf, "quantization_config", None)
    if not quantization:
        return
    if isinstance(quantization, dict):
        method = quantization.get("quant_method")
    else:
        method = getattr(quantization, "quant_method", None)
    method = str(getattr(method, "value", method) or "unknown")
    if method not in SUPPORTED_QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization method {method!r} (config.json quantization_config) is not supported; "
            "serve an unquantized bfloat16/float16/float32 checkpoint or a GGUF file"
        )


def _checkpoint_dtype(hf: Any) -> torch.dtype | None:
    dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    return parse_dtype(str(dtype))


def _rope_config(hf: Any) -> RopeConfig:
    params: dict[str, Any] = dict(getattr(hf, "rope_parameters", None) or {})
    legacy = getattr(hf, "rope_scaling", None)
    if not params and isinstance(legacy, dict):
        params = dict(legacy)
    theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; supported rope types: "
            + ", ".join(SUPPORTED_ROPE_TYPES)
        )
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", hf.max_position_embeddings)
        ),
    )

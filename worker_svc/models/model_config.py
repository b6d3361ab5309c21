"""The facts of a decoder checkpoint that our model code needs, read from config.json.

transformers' configuration classes parse the file (that also normalises old `rope_scaling` /
`rope_theta` keys into transformers 5's `rope_parameters`); no transformers modelling code is
used. `ModelConfig` is what every decoder has (its shape, rope, biases, sliding windows); a
family with knobs of its own extends it in its model file (Gemma's soft caps and scale, the
experts of the mixture-of-experts models, LLaVA's vision tower) and reads it in its
`read_config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Self

import torch

from splitserve_runtime.quantization_names import CONFIG_FORMATS, spoken
from worker_svc.attention.backend import AttentionOptions
from worker_svc.layers.rope_config import RopeConfig, layer_type_rope_configs

SLIDING_ATTENTION = "sliding_attention"

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
class ModelConfig:
    """Shape and flavour of a decoder-only model.

    Qwen2 sets `qkv_bias`; Qwen3 sets `qk_norm` and an explicit `head_dim`; Llama's
    `attention_bias` also biases `o_proj`.
    """

    activations: ClassVar[tuple[str, ...]] = ("silu",)
    """The MLP activations (`hidden_act`) the family's code implements."""

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
    layer_types: tuple[str, ...] = ()
    """Per layer "full_attention" or "sliding_attention" (empty: every layer full)."""
    hidden_act: str = "silu"
    rope_head_dim: int | None = None
    """The rotated width of a head where the rope does not span `head_dim` times the rope's
    partial factor (multi-head latent attention rotates its qk_rope_head_dim part alone)."""
    kv_value_dim: int | None = None
    """A latent cache (multi-head latent attention): the KV cache holds `head_dim` values per
    token and one KV head, keys only, each value being the first `kv_value_dim` of its key."""

    def is_sliding_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` is a sliding-window (local) layer by the checkpoint's
        design, its window in force or not (Gemma 3's local layers keep their own rope)."""
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING_ATTENTION

    def layer_window(self, layer: int) -> int | None:
        """Sliding window of decoder layer `layer` (None: full attention)."""
        return self.sliding_window if self.is_sliding_layer(layer) else None

    def layer_attention(self, layer: int) -> AttentionOptions:
        """How decoder layer `layer` attends (a family may add a scale or a soft cap)."""
        return AttentionOptions(sliding_window=self.layer_window(layer))

    @property
    def kv_sliding_window(self) -> int | None:
        """The window when every layer has one (their KV past it can be freed), else None."""
        windows = {self.layer_window(i) for i in range(self.num_layers)}
        return windows.pop() if len(windows) == 1 else None

    @property
    def max_context_len(self) -> int:
        """Longest sequence the model takes (with rope scaling, as vLLM derives it)."""
        return max(self.max_position_embeddings, self.rope.context_limit())

    @classmethod
    def from_pretrained(cls, model_path: str | Path) -> ModelConfig:
        return cls.from_hf_config(read_hf_config(model_path))

    @classmethod
    def from_hf_config(cls, hf: Any, **fields: Any) -> Self:
        """The fields every decoder has, read from transformers' config `hf`; `fields` give a
        subclass's own (or replace read ones)."""
        arch = architecture_of(hf)
        refuse_quantization(hf)
        if getattr(hf, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention (embedding models) is not supported")
        num_heads = int(hf.num_attention_heads)
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        attention_bias = bool(getattr(hf, "attention_bias", False))
        use_sliding = getattr(hf, "use_sliding_window", True)
        sliding_window = getattr(hf, "sliding_window", None) if use_sliding else None
        read: dict[str, Any] = {
            "architecture": arch,
            "vocab_size": int(hf.vocab_size),
            "hidden_size": int(hf.hidden_size),
            "intermediate_size": int(hf.intermediate_size),
            "num_layers": int(hf.num_hidden_layers),
            "num_heads": num_heads,
            "num_kv_heads": int(getattr(hf, "num_key_value_heads", None) or num_heads),
            "head_dim": int(head_dim),
            "rms_norm_eps": float(hf.rms_norm_eps),
            "max_position_embeddings": int(hf.max_position_embeddings),
            "rope": layer_type_rope_configs(hf)[0],
            "tie_word_embeddings": bool(getattr(hf, "tie_word_embeddings", False)),
            "qkv_bias": attention_bias,
            "o_bias": attention_bias,
            "mlp_bias": bool(getattr(hf, "mlp_bias", False)),
            "checkpoint_dtype": checkpoint_dtype_of(hf),
            "sliding_window": sliding_window,
            "layer_types": _layer_types(hf, sliding_window),
            "hidden_act": _activation(hf, arch, cls.activations),
        }
        return cls(**{**read, **fields})


def read_hf_config(model_path: str | Path) -> Any:
    """transformers' configuration object of a local checkpoint folder."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_path), local_files_only=True)


def architecture_of(hf: Any) -> str:
    architectures = list(getattr(hf, "architectures", None) or [])
    if not architectures:
        raise ValueError("config.json names no architecture ('architectures' is empty)")
    return str(architectures[0])


def refuse_quantization(hf: Any) -> None:
    """A quantized checkpoint must never be served as if its weights were plain floats: a
    `quant_method` no registry row reads from config.json (splitserve_runtime/
    quantization_names.py) is refused."""
    quantization = getattr(hf, "quantization_config", None)
    if not quantization:
        return
    method = quant_method(quantization)
    if method not in CONFIG_FORMATS:
        raise ValueError(
            f"quantization method {method!r} (config.json quantization_config) is not supported; "
            "serve an unquantized (bfloat16/float16/float32) checkpoint, one quantized with "
            f"{spoken(CONFIG_FORMATS, 'or')}, or a GGUF file"
        )


def quant_method(quantization: Any) -> str:
    """The `quant_method` of a `quantization_config` (a dict, or transformers' object)."""
    if isinstance(quantization, dict):
        method = quantization.get("quant_method")
    else:
        method = getattr(quantization, "quant_method", None)
    return str(getattr(method, "value", method) or "unknown")


def checkpoint_dtype_of(hf: Any) -> torch.dtype | None:
    dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    return parse_dtype(str(dtype))


def _activation(hf: Any, arch: str, supported: tuple[str, ...]) -> str:
    """The MLP activation (Gemma names it `hidden_activation`)."""
    act = str(getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu"))
    if act not in supported:
        raise ValueError(
            f"hidden_act {act!r} is not supported for {arch}; supported activations: "
            + ", ".join(supported)
        )
    return act


def _layer_types(hf: Any, sliding_window: int | None) -> tuple[str, ...]:
    """Per-layer attention types: the config's `layer_types`, else every layer sliding when
    the config has a window (Mistral, Phi-3, Mixtral)."""
    if sliding_window is None:
        return ()
    declared = getattr(hf, "layer_types", None)
    if declared:
        return tuple(str(t) for t in declared)
    return (SLIDING_ATTENTION,) * int(hf.num_hidden_layers)

"""Which `architectures` from config.json we can serve, and with which model class.

One row per architecture: the module under worker_svc/models and the class in it, imported on
first use (as vLLM's and mini-sglang's registries), so serving one family never imports the
others. Every class is an `interfaces.CausalLM`; a new architecture is its model file plus a
row here.
"""

from __future__ import annotations

import pkgutil
from typing import Any

from worker_svc.models.interfaces import CausalLM
from worker_svc.models.model_config import ModelConfig, architecture_of

_MODELS: dict[str, tuple[str, str]] = {
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "GraniteForCausalLM": ("granite", "GraniteForCausalLM"),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}
"""Architecture -> (module under worker_svc/models, class)."""

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_MODELS))


class UnsupportedArchitectureError(ValueError):
    """config.json names an architecture we have no model code for."""


def model_class(architecture: str) -> type[CausalLM]:
    """The class serving `architecture` (its module imported now)."""
    if architecture not in _MODELS:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported; supported architectures: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    module, name = _MODELS[architecture]
    cls: type[CausalLM] = pkgutil.resolve_name(f"{__package__}.{module}:{name}")
    return cls


def read_model_config(hf: Any) -> ModelConfig:
    """The ModelConfig of a checkpoint's configuration, as its architecture's class reads it
    (multimodal ones describe their language model, with the rest in their own fields)."""
    return model_class(architecture_of(hf)).read_config(hf)

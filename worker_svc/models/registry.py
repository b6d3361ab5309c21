"""Which `architectures` from config.json we can serve, and with which model class."""

from __future__ import annotations

from typing import Any

from worker_svc.models.llama import LlamaForCausalLM
from worker_svc.models.llava import LlavaForConditionalGeneration, llava_model_config
from worker_svc.models.model_config import ModelConfig, architecture_of

_MODELS: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_MODELS))


class UnsupportedArchitectureError(ValueError):
    """config.json names an architecture we have no model code for."""


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    try:
        return _MODELS[architecture]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported; supported architectures: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        ) from None


def read_model_config(hf: Any) -> ModelConfig:
    """The ModelConfig of a checkpoint's configuration (multimodal ones describe their
    language model, with the vision side in `vision`)."""
    if architecture_of(hf) == "LlavaForConditionalGeneration":
        return llava_model_config(hf)
    return ModelConfig.from_hf_config(hf)

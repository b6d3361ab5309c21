"""Which `architectures` from config.json we can serve, and with which model class."""

from __future__ import annotations

from typing import Any

from worker_svc.models.gemma2 import Gemma2ForCausalLM
from worker_svc.models.gemma3 import Gemma3ForCausalLM
from worker_svc.models.llama import LlamaForCausalLM
from worker_svc.models.llava import LlavaForConditionalGeneration, llava_model_config
from worker_svc.models.mixtral import MixtralForCausalLM
from worker_svc.models.model_config import ModelConfig, architecture_of
from worker_svc.models.phi3 import Phi3ForCausalLM
from worker_svc.models.qwen3_moe import Qwen3MoeForCausalLM

_MODELS: dict[str, type[LlamaForCausalLM]] = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
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

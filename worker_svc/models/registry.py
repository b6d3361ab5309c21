"""Which `architectures` from config.json we can serve, and with which model class.

One row per architecture: the module under worker_svc/models and the class in it, imported on
first use (as vLLM's and mini-sglang's registries), so serving one family never imports the
others. Every class is an `interfaces.CausalLM` (an encoder-only one also
`interfaces.EncoderOnly`); a new architecture is its model file plus a row here.
"""

from __future__ import annotations

import pkgutil
from typing import Any

from worker_svc.models.interfaces import CausalLM
from worker_svc.models.model_config import ModelConfig, architecture_of

_MODELS: dict[str, tuple[str, str]] = {
    "DeepseekV2ForCausalLM": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Glm4ForCausalLM": ("glm4", "Glm4ForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    "GraniteForCausalLM": ("granite", "GraniteForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("granitemoehybrid", "GraniteMoeHybridForCausalLM"),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Olmo2ForCausalLM": ("olmo2", "Olmo2ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Qwen3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen3NextForCausalLM": ("qwen3_next", "Qwen3NextForCausalLM"),
    "SmolLM3ForCausalLM": ("smollm3", "SmolLM3ForCausalLM"),
}
"""Architecture -> (module under worker_svc/models, class)."""

_BARE_MODELS: dict[str, str] = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}
"""Checkpoints of a decoder without its LM head (what sentence-transformers saves: transformers'
AutoModel, tensors without the "model." prefix) -> the family serving them, as pooling models
only (models/adapters.py)."""

_SEQ_CLS_MODELS: dict[str, str] = {
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "MistralForSequenceClassification": "MistralForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
}
"""Decoders with a sequence-classification head (`score`) instead of the LM head: cross-encoders
(rerankers), served as pooling models (the last token, then the head)."""

_ENCODER_MODELS: dict[str, tuple[str, str]] = {"BertModel": ("bert", "BertModel")}
"""Encoder-only models (bidirectional attention, `interfaces.EncoderOnly`): embedders served as
pooling models only."""

_ENCODER_ONLY_PREFIXES = ("Bert", "Roberta", "XLMRoberta", "ModernBert", "NomicBert", "New", "Gte")
"""Encoder-only families (bge, gte, e5, ...): only BertModel is served."""

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_MODELS))
POOLING_ONLY_ARCHITECTURES: tuple[str, ...] = tuple(
    sorted([*_BARE_MODELS, *_SEQ_CLS_MODELS, *_ENCODER_MODELS])
)


class UnsupportedArchitectureError(ValueError):
    """config.json names an architecture we have no model code for."""


def model_class(architecture: str) -> type[CausalLM]:
    """The class serving `architecture` (its module imported now)."""
    architecture = _BARE_MODELS.get(architecture, _SEQ_CLS_MODELS.get(architecture, architecture))
    if architecture.startswith(_ENCODER_ONLY_PREFIXES) and architecture not in _ENCODER_MODELS:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is an encoder-only model splitserve does not serve; "
            "of the encoder-only families it serves BertModel embedders (bge, gte, e5, MiniLM; "
            "no BERT cross-encoders: their pairs need token_type_ids)"
        )
    row = _MODELS.get(architecture) or _ENCODER_MODELS.get(architecture)
    if row is None:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported; supported architectures: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
            + "; for pooling only: "
            + ", ".join(POOLING_ONLY_ARCHITECTURES)
        )
    module, name = row
    cls: type[CausalLM] = pkgutil.resolve_name(f"{__package__}.{module}:{name}")
    return cls


def read_model_config(hf: Any) -> ModelConfig:
    """The ModelConfig of a checkpoint's configuration, as its architecture's class reads it
    (multimodal ones describe their language model, with the rest in their own fields)."""
    return model_class(architecture_of(hf)).read_config(hf)


def has_lm_head(architecture: str) -> bool:
    """Whether the checkpoint has a language-model head (a bare decoder serves pooling only)."""
    return not any(architecture in t for t in (_BARE_MODELS, _SEQ_CLS_MODELS, _ENCODER_MODELS))


def is_sequence_classifier(architecture: str) -> bool:
    """Whether the checkpoint holds a sequence-classification head (a cross-encoder)."""
    return architecture in _SEQ_CLS_MODELS


def pooling_model_class(architecture: str, num_labels: int = 1) -> type[CausalLM]:
    """The pooling form of `architecture` (vLLM's as_embedding_model): a text decoder family
    without its LM head; ValueError (one line) for what cannot pool."""
    from worker_svc.models.adapters import as_embedding_model, as_seq_cls_model
    from worker_svc.models.decoder import DecoderForCausalLM

    cls = model_class(architecture)
    if architecture in _ENCODER_MODELS:
        return cls  # an embedder as it is
    if not issubclass(cls, DecoderForCausalLM) or getattr(cls, "supports_images", False):
        raise ValueError(f"{architecture} cannot be served as a pooling model (--runner pooling)")
    if is_sequence_classifier(architecture):
        return as_seq_cls_model(cls, num_labels)
    return as_embedding_model(cls)

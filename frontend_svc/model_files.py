"""What a frontend reads from the model: its tokenizer, its generation config (eos ids and
sampling defaults) and, when the engine says the model takes images, its image processor. The
frontend service and the offline `LLM` API read them the same way."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from frontend_svc.generation_config import (
    eos_token_ids,
    generation_config_folder,
    log_sampling_defaults,
    read_generation_config,
    sampling_defaults,
)
from frontend_svc.input_processor import load_tokenizer
from frontend_svc.media import DEFAULT_MEDIA_LIMITS, MediaLimits
from frontend_svc.multimodal import MultiModalProcessor, load_multimodal_processor
from splitserve_contracts import sampling_rules
from splitserve_contracts.sampling_rules import Limits
from splitserve_contracts.sampling_types import SamplingParams
from splitserve_runtime.model_source import resolve_model, resolve_tokenizer


@dataclass(frozen=True, slots=True)
class ModelFiles:
    """The tokenizer and what the generation config says."""

    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    sampling_defaults: dict[str, Any]
    folder: Path | None = None
    """The checkpoint folder (None: a GGUF file)."""
    media_limits: MediaLimits = DEFAULT_MEDIA_LIMITS

    def multimodal_processor(self, num_image_tokens: int) -> MultiModalProcessor | None:
        """The image processor when the engine's model takes images, each as
        `num_image_tokens` placeholder tokens (EngineInfo.max_tokens_per_mm_item); None when
        it takes text only (0)."""
        if num_image_tokens == 0:
            return None
        if self.folder is None:
            raise ValueError(
                "the engine's model takes images, but a GGUF file has no image processor"
            )
        return load_multimodal_processor(
            self.folder, self.tokenizer, self.media_limits, num_image_tokens
        )


def load_model_files(
    model_spec: str,
    revision: str = "",
    tokenizer_spec: str = "",
    generation_config: str = "auto",
    media_limits: MediaLimits = DEFAULT_MEDIA_LIMITS,
) -> ModelFiles:
    """Resolve --model/--tokenizer as the workers do and read the files; ValueError/OSError
    when they cannot be found or read, or the generation config's defaults are invalid."""
    model = resolve_model(model_spec, revision)
    source = resolve_tokenizer(model, tokenizer_spec, revision)
    tokenizer = load_tokenizer(str(source.path))
    folder = None if model.is_gguf else model.path
    generation = read_generation_config(generation_config_folder(generation_config, folder))
    defaults = sampling_defaults(generation, generation_config)
    try:
        sampling_rules.validate(SamplingParams(**defaults), Limits(vocab_size=len(tokenizer)))
    except sampling_rules.InvalidSamplingParams as err:
        raise ValueError(
            f"the generation config's sampling defaults are invalid ({err}); pass "
            "--generation-config vllm"
        ) from None
    log_sampling_defaults(defaults, generation_config)
    return ModelFiles(tokenizer, eos_token_ids(generation), defaults, folder, media_limits)

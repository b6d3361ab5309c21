"""What a frontend reads from the model: its tokenizer, its generation config (eos ids and
sampling defaults) and, when the engine says the model takes images, its image processor. The
frontend service and the offline `LLM` API read them the same way."""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from frontend_svc.engine.engine_types import TokenizerInfo
from frontend_svc.inputs.generation_config import (
    eos_token_ids,
    generation_config_folder,
    log_sampling_defaults,
    read_generation_config,
    sampling_defaults,
)
from frontend_svc.inputs.input_processor import load_tokenizer
from frontend_svc.inputs.media import DEFAULT_MEDIA_LIMITS, MediaLimits
from frontend_svc.inputs.multimodal import MultiModalProcessor, load_multimodal_processor
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
    tokenizer_info: TokenizerInfo | None = None
    """What the engine core needs of the tokenizer for structured outputs; None when the
    tokenizer has no serialized form (not a fast tokenizer)."""
    tokenizer_folder: Path | None = None
    """The folder the tokenizer was read from (None: it came out of a .gguf file, or
    --chat-template replaced its template: a gateway then gets it saved as loaded)."""
    model_config: dict[str, Any] = field(default_factory=dict)
    """The checkpoint's config.json ({} when it has none, e.g. a .gguf file)."""

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


def tokenizer_info(tokenizer: Any, eos_token_ids: tuple[int, ...]) -> TokenizerInfo | None:
    """The serialized form of a fast tokenizer (as llguidance's from_tokenizer takes it:
    without padding or truncation); None for any other tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return TokenizerInfo(backend.to_str(), tuple(dict.fromkeys([*eos, *eos_token_ids])))


def load_model_files(
    model_spec: str,
    revision: str = "",
    tokenizer_spec: str = "",
    generation_config: str = "auto",
    media_limits: MediaLimits = DEFAULT_MEDIA_LIMITS,
    chat_template: str = "",
) -> ModelFiles:
    """Resolve --model/--tokenizer as the workers do and read the files; ValueError/OSError
    when they cannot be found or read, or the generation config's defaults are invalid.
    `chat_template` (--chat-template's text) replaces the tokenizer's own."""
    model = resolve_model(model_spec, revision)
    source = resolve_tokenizer(model, tokenizer_spec, revision)
    tokenizer = load_tokenizer(str(source.path))
    if chat_template:
        tokenizer.chat_template = chat_template
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
    eos_ids = eos_token_ids(generation)
    return ModelFiles(
        tokenizer,
        eos_ids,
        defaults,
        folder,
        media_limits,
        tokenizer_info(tokenizer, eos_ids),
        tokenizer_folder=None if source.is_gguf or chat_template else source.path,
        model_config=_read_config(folder),
    )


def _read_config(folder: Path | None) -> dict[str, Any]:
    if folder is None or not (folder / "config.json").is_file():
        return {}
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as err:
        logging.getLogger(__name__).warning("cannot read %s/config.json: %s", folder, err)
        return {}
    return config if isinstance(config, dict) else {}

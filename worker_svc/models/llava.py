"""LLaVA-1.5 (`LlavaForConditionalGeneration`): a CLIP vision tower and an MLP projector in
front of a Llama language model.

The language model is our Llama (`language_model`), sharded over the tensor-parallel group as
usual; the LLaVA model holds it and passes its calls on. The vision
tower and the projector are small and run replicated on every tensor-parallel rank of the first
pipeline stage: each rank computes the same image embeddings with no collective, and later
stages hold no vision weights. `encode_images` turns pixel values into one embedding row per
placeholder token; the encoder runner writes those rows over the placeholders' token
embeddings (`embed_input_ids`) before the first decoder layer.

Checkpoints name tensors in two layouts, both read: transformers 4's (`language_model.model.*`,
`language_model.lm_head.*`, `vision_tower.vision_model.*`, `multi_modal_projector.*`) and
transformers 5's (`model.language_model.*`, `lm_head.*`, `model.vision_tower.*`, ...).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from worker_svc.layers.tensor_source import TensorSource, copy_checked
from worker_svc.models.clip import ClipVisionTower, vision_activation
from worker_svc.models.decoder import BuildContext, StepContext, join_prefix
from worker_svc.models.language_model_wrapper import WrapsLanguageModel
from worker_svc.models.llama import LlamaForCausalLM
from worker_svc.models.model_config import ModelConfig, parse_dtype
from worker_svc.models.vision_config import ClipVisionConfig, LlavaVisionConfig
from worker_svc.models.weight_names import WeightTarget

SUPPORTED_TEXT_MODELS = ("llama", "mistral")
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")


@dataclass(frozen=True, slots=True, kw_only=True)
class LlavaConfig(ModelConfig):
    """The language model's config (every field of ModelConfig) and the vision side."""

    vision: LlavaVisionConfig


def llava_model_config(hf: Any) -> LlavaConfig:
    """The language model's ModelConfig, with the vision side in `vision`."""
    text = hf.text_config
    if text.model_type not in SUPPORTED_TEXT_MODELS:
        raise ValueError(
            f"LLaVA with a {text.model_type!r} language model is not supported; supported: "
            + ", ".join(SUPPORTED_TEXT_MODELS)
        )
    text = copy.copy(text)
    text.architectures = ["LlamaForCausalLM"]
    config = LlamaForCausalLM.read_config(text)
    strategy = getattr(hf, "vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported")
    layers = hf.vision_feature_layer
    vision = LlavaVisionConfig(
        vision=_clip_config(hf.vision_config),
        image_token_id=int(getattr(hf, "image_token_id", None) or hf.image_token_index),
        feature_layers=tuple(layers) if isinstance(layers, list | tuple) else (int(layers),),
        keeps_cls_token=strategy == "full",
        projector_act=str(getattr(hf, "projector_hidden_act", "gelu")),
        projector_bias=bool(getattr(hf, "multimodal_projector_bias", True)),
    )
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    fields["architecture"] = "LlavaForConditionalGeneration"
    fields["checkpoint_dtype"] = config.checkpoint_dtype or _stored_dtype(hf)
    return LlavaConfig(**fields, vision=vision)


def _stored_dtype(hf: Any) -> torch.dtype | None:
    dtype = getattr(hf, "dtype", None)
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    return parse_dtype(str(dtype))


def _clip_config(cfg: Any) -> ClipVisionConfig:
    if cfg.model_type not in ("clip_vision_model", "clip"):
        raise ValueError(f"LLaVA vision tower {cfg.model_type!r} is not supported; CLIP only")
    return ClipVisionConfig(
        hidden_size=int(cfg.hidden_size),
        intermediate_size=int(cfg.intermediate_size),
        num_layers=int(cfg.num_hidden_layers),
        num_heads=int(cfg.num_attention_heads),
        image_size=int(cfg.image_size),
        patch_size=int(cfg.patch_size),
        num_channels=int(getattr(cfg, "num_channels", 3)),
        layer_norm_eps=float(getattr(cfg, "layer_norm_eps", 1e-5)),
        hidden_act=str(getattr(cfg, "hidden_act", "quick_gelu")),
    )


def normalize_llava_name(name: str) -> str:
    """A checkpoint tensor name in one layout: `vision_tower.<CLIP transformer>`,
    `multi_modal_projector.*`, or the Llama names (`model.*`, `lm_head.*`)."""
    if name.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
        name = name.removeprefix("model.")
    if name.startswith("vision_tower."):
        return "vision_tower." + name.removeprefix("vision_tower.").removeprefix("vision_model.")
    for prefix, replacement in (
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("language_model.", "model."),
    ):
        if name.startswith(prefix):
            return replacement + name.removeprefix(prefix)
    return name


class LlavaProjector(nn.Module):
    """linear_2(act(linear_1(vision features))), replicated."""

    def __init__(self, vision: LlavaVisionConfig, text_hidden: int, dtype: torch.dtype,
                 device: torch.device) -> None:  # fmt: skip
        super().__init__()
        width = vision.vision.hidden_size * len(vision.feature_layers)
        bias = vision.projector_bias
        self.act = vision.projector_act
        self.linear_1 = nn.Linear(width, text_hidden, bias=bias, dtype=dtype, device=device)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(vision_activation(self.act, self.linear_1(x)))


class LlavaForConditionalGeneration(WrapsLanguageModel):
    """One pipeline stage of a LLaVA model; see the module docstring."""

    supports_images: ClassVar[Literal[True]] = True
    packed_modules_mapping: ClassVar[Mapping[str, tuple[str, ...]]] = (
        LlamaForCausalLM.packed_modules_mapping
    )

    def __init__(self, build: BuildContext, prefix: str = "") -> None:
        super().__init__()
        config = build.config
        if not isinstance(config, LlavaConfig):
            raise ValueError("a LLaVA model needs its vision config")
        self.config = config
        self.vision_config = config.vision
        self.language_model = LlamaForCausalLM(build, join_prefix(prefix, "language_model"))
        self.layer_range = self.language_model.layer_range
        self.vision_tower: ClipVisionTower | None = None
        self.multi_modal_projector: LlavaProjector | None = None
        if build.parallel.is_first_stage:
            dtype, device = build.dtype, build.device
            self.vision_tower = ClipVisionTower(
                config.vision.vision, config.vision.num_layers_to_run, dtype, device
            )
            self.multi_modal_projector = LlavaProjector(
                config.vision, config.hidden_size, dtype, device
            )

    @classmethod
    def read_config(cls, hf: Any) -> ModelConfig:
        return llava_model_config(hf)

    # -- images (interfaces.SupportsImages) ------------------------------------------------------

    @property
    def image_input_shape(self) -> tuple[int, int, int]:
        vision = self.vision_config.vision
        return vision.num_channels, vision.image_size, vision.image_size

    @property
    def num_image_tokens(self) -> int:
        return self.vision_config.num_image_tokens

    @property
    def max_image_tokens(self) -> int:
        return self.num_image_tokens

    def image_problem(
        self, shape: tuple[int, ...], grid_thw: tuple[int, ...], num_tokens: int
    ) -> str | None:
        if grid_thw:
            return f"grid_thw {list(grid_thw)}: LLaVA's images have a fixed size and no grid"
        if shape != self.image_input_shape or num_tokens != self.num_image_tokens:
            return (
                f"{list(shape)} pixels for {num_tokens} placeholders; the model takes "
                f"{list(self.image_input_shape)} for {self.num_image_tokens}"
            )
        return None

    def encode_images(
        self, pixel_values: Sequence[torch.Tensor], grids: Sequence[tuple[int, ...]]
    ) -> list[torch.Tensor]:
        """Embeddings [num_image_tokens, hidden] of each image's pixel values [C, H, W]."""
        assert self.vision_tower is not None and self.multi_modal_projector is not None
        vision = self.vision_config
        dtype = self.vision_tower.pre_layrnorm.weight.dtype
        states = self.vision_tower(
            torch.stack(list(pixel_values)).to(dtype), vision.hidden_state_indices
        )
        if not vision.keeps_cls_token:
            states = [s[:, 1:] for s in states]
        return list(self.multi_modal_projector(torch.cat(states, dim=-1)))

    # -- the language model's ----------------------------------------------------------------

    def step_context(self, positions: torch.Tensor, attn_metadata: object) -> StepContext:
        return self.language_model.step_context(positions, attn_metadata)

    # -- weights -------------------------------------------------------------------------------

    def resolve_weight_name(self, name: str) -> list[WeightTarget]:
        """The language model's targets (the vision tensors are loaded by name, not here)."""
        name = normalize_llava_name(name)
        if name.startswith(_VISION_PREFIXES):
            return []
        return self.language_model.resolve_weight_name(name)

    def load_weights(self, weights: Iterable[tuple[str, TensorSource]]) -> None:
        """Vision tensors go to the replicated vision modules (on the first stage); the rest
        to the language model, renamed to its layout; raise if a parameter stays unset."""
        loaded: set[str] = set()
        self.language_model.load_weights(self._language_weights(weights, loaded))
        missing = [
            name
            for name, _ in self.named_parameters()
            if name.startswith(_VISION_PREFIXES) and name not in loaded
        ]
        if missing:
            raise ValueError(f"checkpoint lacks tensors for: {', '.join(sorted(missing))}")

    def _language_weights(
        self, weights: Iterable[tuple[str, TensorSource]], loaded: set[str]
    ) -> Iterator[tuple[str, TensorSource]]:
        for name, source in weights:
            name = normalize_llava_name(name)
            if name.startswith(_VISION_PREFIXES):
                if self._load_vision(name, source):
                    loaded.add(name)
            else:
                yield name, source

    def _load_vision(self, name: str, source: TensorSource) -> bool:
        """Load one vision tensor; False when this stage does not hold it."""
        if self.vision_tower is None or name.startswith("vision_tower.post_layernorm."):
            return False  # another stage's, or not used (LLaVA reads hidden states, not the pool)
        try:
            param = self.get_parameter(name)
        except AttributeError:
            if name.startswith("vision_tower.encoder.layers."):
                return False  # a layer after the last selected hidden state
            raise ValueError(f"checkpoint tensor {name!r} has no place in a LLaVA model") from None
        with torch.no_grad():
            copy_checked(param, source[:], name)
        return True

"""LLaVA-1.5 (`LlavaForConditionalGeneration`): a CLIP vision tower and an MLP projector in
front of a Llama language model.

The language model is our Llama, sharded over the tensor-parallel group as usual. The vision
tower and the projector are small and run replicated on every tensor-parallel rank of the first
pipeline stage: each rank computes the same image embeddings with no collective, and later
stages hold no vision weights. `encode_images` turns pixel values into one embedding row per
placeholder token; the model runner writes those rows over the placeholders' token embeddings
(`embed_with_mm`) before the first decoder layer.

Checkpoints name tensors in two layouts, both read: transformers 4's (`language_model.model.*`,
`language_model.lm_head.*`, `vision_tower.vision_model.*`, `multi_modal_projector.*`) and
transformers 5's (`model.language_model.*`, `lm_head.*`, `model.vision_tower.*`, ...).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from worker_svc.attention.backend import AttentionBackend
from worker_svc.distributed import ParallelState
from worker_svc.layers.tensor_source import TensorSource, copy_checked
from worker_svc.models.clip import ClipVisionTower, vision_activation
from worker_svc.models.llama import LlamaForCausalLM
from worker_svc.models.model_config import ModelConfig, parse_dtype
from worker_svc.models.vision_config import ClipVisionConfig, LlavaVisionConfig

SUPPORTED_TEXT_MODELS = ("llama", "mistral")
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")


def llava_model_config(hf: Any) -> ModelConfig:
    """ModelConfig of the language model, carrying the vision side in `vision`."""
    text = hf.text_config
    if text.model_type not in SUPPORTED_TEXT_MODELS:
        raise ValueError(
            f"LLaVA with a {text.model_type!r} language model is not supported; supported: "
            + ", ".join(SUPPORTED_TEXT_MODELS)
        )
    text = copy.copy(text)
    text.architectures = ["LlamaForCausalLM"]
    config = ModelConfig.from_hf_config(text)
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
    return dataclasses.replace(
        config,
        architecture="LlavaForConditionalGeneration",
        checkpoint_dtype=config.checkpoint_dtype or _stored_dtype(hf),
        vision=vision,
    )


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


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """One pipeline stage of a LLaVA model; see the module docstring."""

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelState,
        backend: AttentionBackend,
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        context_len: int | None = None,
    ) -> None:
        super().__init__(
            config,
            parallel,
            backend,
            dtype=dtype,
            device=device,
            max_positions=max_positions,
            context_len=context_len,
        )
        if config.vision is None:
            raise ValueError("a LLaVA model needs its vision config")
        self.vision_config = config.vision
        self.vision_tower: ClipVisionTower | None = None
        self.multi_modal_projector: LlavaProjector | None = None
        if parallel.is_first_stage:
            self.vision_tower = ClipVisionTower(
                config.vision.vision, config.vision.num_layers_to_run, dtype, device
            )
            self.multi_modal_projector = LlavaProjector(
                config.vision, config.hidden_size, dtype, device
            )
        self._vision_parts: dict[str, set[int]] = {}

    @property
    def max_tokens_per_mm_item(self) -> int:
        return self.vision_config.num_image_tokens

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Embeddings [images, num_image_tokens, hidden] of pixel values [images, C, H, W]."""
        assert self.vision_tower is not None and self.multi_modal_projector is not None
        vision = self.vision_config
        dtype = self.vision_tower.pre_layrnorm.weight.dtype
        states = self.vision_tower(pixel_values.to(dtype), vision.hidden_state_indices)
        if not vision.keeps_cls_token:
            states = [s[:, 1:] for s in states]
        return self.multi_modal_projector(torch.cat(states, dim=-1))

    def embed_with_mm(
        self, input_ids: torch.Tensor, index: torch.Tensor, embeddings: torch.Tensor
    ) -> torch.Tensor:
        """Token embeddings with rows `index` replaced by multimodal embeddings."""
        assert self.embed_tokens is not None
        hidden = self.embed_tokens(input_ids)
        hidden[index] = embeddings.to(hidden.dtype)
        return hidden

    def load_weights(self, weights: Iterable[tuple[str, TensorSource]]) -> None:
        """Vision tensors go to the replicated vision modules (on the first stage); the rest
        to the Llama loader, renamed to its layout."""
        super().load_weights(self._language_weights(weights))

    def _language_weights(
        self, weights: Iterable[tuple[str, TensorSource]]
    ) -> Iterator[tuple[str, TensorSource]]:
        for name, source in weights:
            name = normalize_llava_name(name)
            if name.startswith(_VISION_PREFIXES):
                self._load_vision(name, source)
            else:
                yield name, source

    def _load_vision(self, name: str, source: TensorSource) -> None:
        if self.vision_tower is None or name.startswith("vision_tower.post_layernorm."):
            return  # another stage's, or not used (LLaVA reads hidden states, not the pool)
        try:
            param = self.get_parameter(name)
        except AttributeError:
            if name.startswith("vision_tower.encoder.layers."):
                return  # a layer after the last selected hidden state
            raise ValueError(f"checkpoint tensor {name!r} has no place in a LLaVA model") from None
        with torch.no_grad():
            copy_checked(param, source[:], name)
        self._vision_parts[name] = {0}

    def _check_complete(self, parts: dict[str, set[int]]) -> None:
        super()._check_complete({**parts, **self._vision_parts})

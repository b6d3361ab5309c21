"""The facts of a LLaVA-style checkpoint's vision side (CLIP vision tower and projector), read
from config.json by `models/llava.py` (its `LlavaConfig` carries them); kept apart so that
`models/clip.py` reads them without the LLaVA model."""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_VISION_ACTIVATIONS = ("quick_gelu", "gelu", "silu", "gelu_new", "gelu_pytorch_tanh")


@dataclass(frozen=True, slots=True)
class ClipVisionConfig:
    """Shape of a CLIP vision transformer (transformers' CLIPVisionConfig)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True, slots=True)
class LlavaVisionConfig:
    """The vision tower, which of its hidden states feed the projector, and the projector."""

    vision: ClipVisionConfig
    image_token_id: int
    feature_layers: tuple[int, ...]
    """Hidden-state indices (0: the embeddings, i: after layer i; negative from the end),
    concatenated when several (transformers' vision_feature_layer)."""
    keeps_cls_token: bool
    """vision_feature_select_strategy "full"; "default" drops the CLS row."""
    projector_act: str = "gelu"
    projector_bias: bool = True

    @property
    def num_image_tokens(self) -> int:
        """Placeholder tokens (= embedding rows) of one image."""
        return self.vision.num_patches + int(self.keeps_cls_token)

    @property
    def hidden_state_indices(self) -> tuple[int, ...]:
        """feature_layers as non-negative indices into the num_layers + 1 hidden states."""
        n = self.vision.num_layers + 1
        return tuple(i if i >= 0 else n + i for i in self.feature_layers)

    @property
    def num_layers_to_run(self) -> int:
        """Vision layers needed for the selected hidden states (LLaVA-1.5 skips the last)."""
        return max(self.hidden_state_indices)

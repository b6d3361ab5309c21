"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): a dynamic-resolution vision tower
(models/qwen2_5_vl_vision.py) in front of a Qwen2 language model positioned with M-RoPE.

The language model is our Llama-family Qwen2 (`language_model`), sharded over the
tensor-parallel group; its rotary embedding is `layers.rotary.MRotaryEmbedding` (the config's
mrope_section), so its decoder layers are Qwen2's own. The vision tower runs replicated on every
rank of the first pipeline stage, like LLaVA's CLIP.

An image is pixel patches [t*h*w, C*T*P*P] with its grid (t, h, w); it takes t*h*w / merge^2
placeholder tokens. Positions (`mrope_positions`, transformers' get_rope_index for images): text
tokens count on with three equal rows; an image's placeholders get (start, start + row,
start + column) over its merged grid, and the text after it continues from
start + max(rows, columns). Tokens past the prompt take position + delta on all rows.

Checkpoint layouts read: transformers 5's (`model.language_model.*`, `model.visual.*`,
`lm_head.*`) and transformers 4's (`model.*`, `visual.*`, `lm_head.*`). Video inputs are not
served (the frontend refuses them; a grid with t > 1 is refused here).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import numpy.typing as npt
import torch

from worker_svc.layers.tensor_source import TensorSource, copy_checked
from worker_svc.models.decoder import BuildContext, StepContext, join_prefix
from worker_svc.models.language_model_wrapper import WrapsLanguageModel
from worker_svc.models.llama import LlamaForCausalLM
from worker_svc.models.model_config import ModelConfig, parse_dtype
from worker_svc.models.qwen2_5_vl_vision import (
    QwenVisionConfig,
    QwenVisionTower,
    qwen_vision_config,
)
from worker_svc.models.weight_names import WeightTarget

_VISION_PREFIX = "visual."


@dataclass(frozen=True, slots=True, kw_only=True)
class Qwen2_5_VLConfig(ModelConfig):  # noqa: N801 (transformers' name)
    """The language model's config (every field of ModelConfig) and the vision side."""

    vision: QwenVisionConfig
    image_token_id: int


def qwen2_5_vl_config(hf: Any) -> Qwen2_5_VLConfig:
    """The language model's ModelConfig (Qwen2 with M-RoPE), the vision tower in `vision`;
    refuses what is not implemented."""
    text = copy.copy(getattr(hf, "text_config", None) or hf)
    text.architectures = ["Qwen2ForCausalLM"]
    config = LlamaForCausalLM.read_config(text)
    if len(config.rope.mrope_section) != 3:
        raise ValueError(
            "Qwen2.5-VL needs rope_parameters.mrope_section (three runs); the config has "
            f"{list(config.rope.mrope_section)}"
        )
    if config.rope.rope_type != "default":
        raise ValueError(f"Qwen2.5-VL with rope type {config.rope.rope_type!r} is not supported")
    if getattr(text, "use_sliding_window", False):
        raise ValueError("Qwen2.5-VL with use_sliding_window is not supported")
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    fields["architecture"] = "Qwen2_5_VLForConditionalGeneration"
    fields["checkpoint_dtype"] = config.checkpoint_dtype or _stored_dtype(hf)
    # transformers 5 keeps tie_word_embeddings on the outer config (the 3B ties, 7B does not)
    fields["tie_word_embeddings"] = bool(getattr(hf, "tie_word_embeddings", False))
    vision = qwen_vision_config(hf.vision_config)
    if vision.out_hidden_size != config.hidden_size:
        raise ValueError(
            f"vision out_hidden_size {vision.out_hidden_size} != hidden_size {config.hidden_size}"
        )
    return Qwen2_5_VLConfig(**fields, vision=vision, image_token_id=int(hf.image_token_id))


def _stored_dtype(hf: Any) -> torch.dtype | None:
    dtype = getattr(hf, "dtype", None)
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    return parse_dtype(str(dtype))


def normalize_qwen2_5_vl_name(name: str) -> str:
    """A checkpoint tensor name in one layout: `visual.*` or the Qwen2 names."""
    if name.startswith("model.visual."):
        return name.removeprefix("model.")
    if name.startswith("model.language_model."):
        return "model." + name.removeprefix("model.language_model.")
    return name


def mrope_positions(
    num_prompt_tokens: int, images: Sequence[tuple[int, tuple[int, ...]]], merge: int
) -> tuple[npt.NDArray[np.int64], int]:
    """See the module docstring; `images` are (first placeholder, grid) in prompt order."""
    rows: list[np.ndarray] = []
    done = 0  # prompt tokens laid out
    current = 0  # the next text position
    for offset, (t, h, w) in images:
        rows.append(np.arange(offset - done) + current)
        rows[-1] = np.broadcast_to(rows[-1], (3, len(rows[-1])))
        current += offset - done
        gh, gw = h // merge, w // merge
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        rows.append(np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + current)
        done = offset + t * gh * gw
        current += max(gh, gw)
    tail = np.arange(num_prompt_tokens - done) + current
    rows.append(np.broadcast_to(tail, (3, len(tail))))
    table = np.concatenate(rows, axis=1).astype(np.int64)
    delta = int(table.max()) + 1 - num_prompt_tokens if num_prompt_tokens else 0
    return table, delta


class Qwen2_5_VLForConditionalGeneration(WrapsLanguageModel):  # noqa: N801 (transformers' name)
    """One pipeline stage of a Qwen2.5-VL model; see the module docstring."""

    supports_images: ClassVar[Literal[True]] = True
    uses_mrope: ClassVar[Literal[True]] = True
    packed_modules_mapping: ClassVar[Mapping[str, tuple[str, ...]]] = (
        LlamaForCausalLM.packed_modules_mapping
    )

    def __init__(self, build: BuildContext, prefix: str = "") -> None:
        super().__init__()
        config = build.config
        if not isinstance(config, Qwen2_5_VLConfig):
            raise ValueError("a Qwen2.5-VL model needs its vision config")
        self.config = config
        self.language_model = LlamaForCausalLM(build, join_prefix(prefix, "language_model"))
        self.layer_range = self.language_model.layer_range
        self.max_positions = build.context_len or build.max_positions
        self.visual: QwenVisionTower | None = None
        if build.parallel.is_first_stage:
            self.visual = QwenVisionTower(config.vision, build.dtype, build.device)

    @classmethod
    def read_config(cls, hf: Any) -> ModelConfig:
        return qwen2_5_vl_config(hf)

    # -- images (interfaces.SupportsImages, SupportsMRope) --------------------------------------

    @property
    def max_image_tokens(self) -> int:
        """An image may take any number of tokens the context holds."""
        return self.max_positions

    def image_problem(
        self, shape: tuple[int, ...], grid_thw: tuple[int, ...], num_tokens: int
    ) -> str | None:
        vision = self.config.vision
        problem = vision.grid_problem(grid_thw)
        if problem is not None:
            return problem
        if grid_thw[0] != 1:
            return f"grid_thw {list(grid_thw)}: videos (t > 1) are not supported"
        patches = grid_thw[0] * grid_thw[1] * grid_thw[2]
        if tuple(shape) != (patches, vision.patch_width):
            return (
                f"pixel values {list(shape)} do not fit grid_thw {list(grid_thw)}: the model "
                f"takes [{patches}, {vision.patch_width}]"
            )
        rows = vision.num_tokens((grid_thw[0], grid_thw[1], grid_thw[2]))
        if num_tokens != rows:
            return f"{num_tokens} placeholders for an image of {rows} rows"
        return None

    def encode_images(
        self, pixel_values: Sequence[torch.Tensor], grids: Sequence[tuple[int, ...]]
    ) -> list[torch.Tensor]:
        """Embeddings [t*h*w / merge^2, hidden] of each image's patches."""
        assert self.visual is not None
        thw = [(int(g[0]), int(g[1]), int(g[2])) for g in grids]
        rows = self.visual(torch.cat(list(pixel_values)), thw)
        return list(rows.split([self.config.vision.num_tokens(g) for g in thw]))

    def mrope_positions(
        self, num_prompt_tokens: int, images: Sequence[tuple[int, tuple[int, ...]]]
    ) -> tuple[npt.NDArray[np.int64], int]:
        return mrope_positions(num_prompt_tokens, images, self.config.vision.spatial_merge_size)

    # -- the language model's ----------------------------------------------------------------

    def step_context(self, positions: torch.Tensor, attn_metadata: object) -> StepContext:
        cos, sin = self.language_model.rotary.cos_sin(positions)
        return StepContext(cos, sin, attn_metadata, None)

    # -- weights -------------------------------------------------------------------------------

    def resolve_weight_name(self, name: str) -> list[WeightTarget]:
        name = normalize_qwen2_5_vl_name(name)
        if name.startswith(_VISION_PREFIX):
            return []
        return self.language_model.resolve_weight_name(name)

    def load_weights(self, weights: Iterable[tuple[str, TensorSource]]) -> None:
        """Vision tensors to the replicated tower (first stage), the rest to the language
        model; raise if a parameter stays unset."""
        loaded: set[str] = set()
        self.language_model.load_weights(self._language_weights(weights, loaded))
        missing = [
            name
            for name, _ in self.named_parameters()
            if name.startswith(_VISION_PREFIX) and name not in loaded
        ]
        if missing:
            raise ValueError(f"checkpoint lacks tensors for: {', '.join(sorted(missing))}")

    def _language_weights(
        self, weights: Iterable[tuple[str, TensorSource]], loaded: set[str]
    ) -> Iterator[tuple[str, TensorSource]]:
        for name, source in weights:
            name = normalize_qwen2_5_vl_name(name)
            if not name.startswith(_VISION_PREFIX):
                yield name, source
            elif self.visual is not None:
                self._load_vision(name, source)
                loaded.add(name)

    def _load_vision(self, name: str, source: TensorSource) -> None:
        try:
            param = self.get_parameter(name)
        except AttributeError:
            raise ValueError(f"checkpoint tensor {name!r} has no place in Qwen2.5-VL") from None
        tensor = source[:]
        if name == "visual.patch_embed.proj.weight":  # the Conv3d kernel, flattened
            tensor = tensor.reshape(tensor.shape[0], -1)
        with torch.no_grad():
            copy_checked(param, tensor, name)

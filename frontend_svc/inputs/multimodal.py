"""The InputProcessor's multimodal part (vLLM's "MM processor"), for LLaVA-style models.

Whether the model takes images is the engine's fact (EngineInfo.max_tokens_per_mm_item, from
the workers' model), not a list of architectures here; this module reads how to lay out a
prompt's images from the checkpoint's config.json and image processor.

    images (bytes, data: URLs)  --media.ImageLoader-->  RGB pictures
        --the model's Hugging Face image processor (PIL backend)-->  pixel values
        --content hash-->  identifier
    chat  --template, one image token per image-->  token ids
        --each image token expanded to the image's placeholder tokens-->  prompt + features

Everything here runs in the frontend: the engine core and the workers get each image once,
already processed, with its placeholder range and hash. Bytes are fetched or unpacked and every
header checked on the calling (tokenizer) thread; decoding, the image processor and hashing run
on `--mm-processor-threads` threads frontend-wide (each image can take a few hundred MB while it
is resized), which give freed memory back to the system after each image.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from frontend_svc.errors import InvalidRequest
from frontend_svc.inputs.media import EncodedImage, ImageLoader, MediaLimits, release_freed_memory
from frontend_svc.requests import ChatTurn, ImageInput, MultiModalFeature
from splitserve_contracts.mm_features import IMAGE, feature_identifier, grid_problem

if TYPE_CHECKING:
    from PIL.Image import Image

_CONTENT_LOOP = re.compile(r"\bfor\s+\w+\s+in\s+\w+(\[\s*['\"]content['\"]\s*\]|\.content\b)")


@dataclass(frozen=True, slots=True)
class ImageModelSpec:
    """What the frontend must know of a LLaVA-style model to lay out its prompts."""

    architecture: str
    image_token_id: int
    image_token: str
    image_size: int
    patch_size: int
    keeps_cls_token: bool
    """vision_feature_select_strategy "full" keeps the vision tower's CLS row."""
    merge_size: int = 0
    """Dynamic resolution (Qwen2-VL): an image of patch grid (t, h, w) takes t*h*w /
    merge_size^2 placeholders; 0: fixed-size images (image_size)."""

    @property
    def num_image_tokens(self) -> int:
        """Placeholder tokens of one fixed-size image: one per patch (+ CLS); 0: dynamic."""
        if self.merge_size:
            return 0
        return (self.image_size // self.patch_size) ** 2 + int(self.keeps_cls_token)

    def tokens_of(self, grid_thw: tuple[int, ...]) -> int:
        """Placeholder tokens of an image with this grid (empty: fixed size)."""
        if not grid_thw:
            return self.num_image_tokens
        return math.prod(grid_thw) // self.merge_size**2


@dataclass(frozen=True, slots=True)
class ProcessedImage:
    """One image ready for the engine: pixel values and their content hash."""

    where: str
    pixel_values: np.ndarray
    identifier: str
    grid_thw: tuple[int, ...] = ()
    """The patch grid of a dynamic-resolution image; empty: fixed size."""


def read_image_model_spec(hf_config: Any, tokenizer: Any) -> ImageModelSpec:
    """The spec of a LLaVA-style checkpoint's config (image token, vision tower's image and patch
    size); ValueError when the config has none."""
    architectures = list(getattr(hf_config, "architectures", None) or [""])
    token_id = getattr(hf_config, "image_token_id", None)
    if token_id is None:
        token_id = getattr(hf_config, "image_token_index", None)
    vision = getattr(hf_config, "vision_config", None)
    if token_id is None or vision is None:
        raise ValueError(
            f"the engine takes images, but the model's config.json ({architectures[0]}) names "
            "no image token (image_token_id) or vision tower (vision_config)"
        )
    token = tokenizer.convert_ids_to_tokens(int(token_id))
    if not isinstance(token, str):
        raise ValueError(f"the tokenizer has no token for the image token id {token_id}")
    merge_size = int(getattr(vision, "spatial_merge_size", 0) or 0)
    return ImageModelSpec(
        architecture=architectures[0],
        image_token_id=int(token_id),
        image_token=token,
        image_size=0 if merge_size else int(vision.image_size),
        patch_size=int(vision.patch_size),
        keeps_cls_token=getattr(hf_config, "vision_feature_select_strategy", "default") == "full",
        merge_size=merge_size,
    )


def template_uses_content_parts(template: str) -> bool:
    """Whether a chat template loops over message content (OpenAI-style parts, as LLaVA's
    processor templates do) rather than printing it as a string (vLLM's content format
    detection, by pattern instead of by syntax tree)."""
    return bool(_CONTENT_LOOP.search(template))


def chat_messages(
    turns: Sequence[ChatTurn], image_token: str | None, uses_parts: bool
) -> list[dict[str, Any]]:
    """The messages for apply_chat_template. String templates get each image as the image token
    on its own line before the text (vLLM's placement); part templates get
    {"type": "image"} and {"type": "text"} parts in order."""
    messages: list[dict[str, Any]] = []
    for turn in turns:
        if uses_parts:
            parts: list[dict[str, Any]] = [
                {"type": "image"} if p.image is not None else {"type": "text", "text": p.text}
                for p in turn.parts
            ] or [{"type": "text", "text": turn.content}]
            messages.append({"role": turn.role, "content": parts})
            continue
        lines = [image_token or ""] * len(turn.images) if turn.parts else []
        messages.append({"role": turn.role, "content": "\n".join([*lines, turn.text])})
    return messages


class MultiModalProcessor:
    """Processes the images of prompts for one LLaVA-style model."""

    def __init__(self, spec: ImageModelSpec, image_processor: Any, limits: MediaLimits) -> None:
        self.spec = spec
        self.image_processor = image_processor
        self.limits = limits
        self.loader = ImageLoader(limits)
        self._pool = ThreadPoolExecutor(limits.mm_processor_threads, thread_name_prefix="image")
        self._check_output_shape()

    def _check_output_shape(self) -> None:
        """Fail at start-up when the image processor's output does not fit the vision tower."""
        from PIL import Image

        pixels, grid = self._pixel_values(Image.new("RGB", (7, 5)))
        size = self.spec.image_size
        if self.spec.merge_size:
            problem = grid_problem(grid, pixels.shape[0]) if grid else "no image_grid_thw"
            if problem is not None or math.prod(grid) % self.spec.merge_size**2:
                raise ValueError(
                    f"the image processor's output does not fit the vision tower ({problem or 'grid not a multiple of the merge size'}); check preprocessor_config.json"
                )
            return
        if pixels.shape[1:] != (size, size):
            raise ValueError(
                f"the image processor makes {tuple(pixels.shape)} pixel values but the vision "
                f"tower takes {size}x{size} images; check preprocessor_config.json"
            )

    def _pixel_values(self, image: Any) -> tuple[np.ndarray, tuple[int, ...]]:
        """One image's pixel values, and its patch grid (dynamic resolution: the processor's
        pixel values are then the image's patches [t*h*w, C*T*P*P])."""
        out = self.image_processor(images=[image], return_tensors="np")
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        if not self.spec.merge_size:
            return np.ascontiguousarray(pixels[0]), ()
        grids = out.get("image_grid_thw")
        grid = () if grids is None else tuple(int(d) for d in np.asarray(grids)[0])
        return np.ascontiguousarray(pixels), grid

    def process_images(self, images: Sequence[ImageInput]) -> list[ProcessedImage]:
        """Decode, process and hash each image, in order; InvalidRequest names the bad part."""
        limit = self.limits.max_images_per_prompt
        if len(images) > limit:
            where = images[limit].where
            raise InvalidRequest(
                f"the request has {len(images)} images, more than the {limit} allowed per "
                f"prompt (--limit-mm-per-prompt); {where} is one too many",
                where,
            )
        encoded = [self.loader.encoded(image) for image in images]
        opened = [self.loader.open(image) for image in encoded]  # every header before any pixel
        return [
            self._pool.submit(self._process, image, header).result()
            for image, header in zip(encoded, opened, strict=True)
        ]

    def _process(self, image: EncodedImage, opened: Image) -> ProcessedImage:
        """Decode, process and hash one image (on an image thread)."""
        try:
            pixels, grid = self._pixel_values(self.loader.decode(opened, image))
        finally:
            opened.close()
            release_freed_memory()
        identifier = feature_identifier("float32", pixels.shape, pixels.tobytes(), grid)
        return ProcessedImage(image.where, pixels, identifier, grid)

    def expand(
        self, token_ids: list[int], images: Sequence[ProcessedImage]
    ) -> tuple[list[int], tuple[MultiModalFeature, ...]]:
        """Each image token of the prompt becomes the image's placeholder tokens; the images
        pair with the image tokens in order, and their counts must match."""
        token_id = self.spec.image_token_id
        starts = [i for i, t in enumerate(token_ids) if t == token_id]
        if len(starts) != len(images):
            raise InvalidRequest(
                f"the prompt has {len(starts)} image placeholders ({self.spec.image_token}) but "
                f"{len(images)} images; each image takes one placeholder, which the chat "
                "template adds: leave the placeholder out of your text",
            )
        if not images:
            return token_ids, ()
        expanded: list[int] = []
        features = []
        previous = 0
        for start, image in zip(starts, images, strict=True):
            expanded += token_ids[previous:start]
            num = self.spec.tokens_of(image.grid_thw)
            features.append(
                MultiModalFeature(
                    modality=IMAGE,
                    identifier=image.identifier,
                    offset=len(expanded),
                    length=num,
                    data=image.pixel_values.tobytes(),
                    shape=tuple(int(d) for d in image.pixel_values.shape),
                    dtype="float32",
                    grid_thw=image.grid_thw,
                )
            )
            expanded += [token_id] * num
            previous = start + 1
        expanded += token_ids[previous:]
        return expanded, tuple(features)


def load_multimodal_processor(
    model_path: Path, tokenizer: Any, limits: MediaLimits, num_image_tokens: int
) -> MultiModalProcessor:
    """The processor of the checkpoint folder of a model that takes images, each as
    `num_image_tokens` placeholder tokens (the engine's fact, which the folder's config must
    agree with). Also gives the tokenizer the processor's chat template when it has none of
    its own."""
    from transformers import AutoConfig, AutoImageProcessor

    hf_config = AutoConfig.from_pretrained(str(model_path), local_files_only=True)
    spec = read_image_model_spec(hf_config, tokenizer)
    if not spec.merge_size and spec.num_image_tokens != num_image_tokens:
        raise ValueError(
            f"the engine's model takes {num_image_tokens} placeholder tokens per image, the "
            f"model at {model_path} {spec.num_image_tokens}: serve the same model on both"
        )

    # The PIL backend (transformers 4's use_fast=False): torchvision cannot sit beside our torch.
    image_processor = AutoImageProcessor.from_pretrained(
        str(model_path), backend="pil", local_files_only=True
    )
    if not getattr(tokenizer, "chat_template", None):
        template = _processor_chat_template(model_path)
        if template:
            tokenizer.chat_template = template
    return MultiModalProcessor(spec, image_processor, limits)


def _processor_chat_template(model_path: Path) -> str | None:
    """chat_template.jinja or chat_template.json of a processor, when the folder has one."""

    jinja = model_path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    path = model_path / "chat_template.json"
    if path.is_file():
        template = json.loads(path.read_text()).get("chat_template")
        return template if isinstance(template, str) else None
    return None

"""The frontend's multimodal processing: images decoded within limits, processed by the model's
image processor, hashed, their placeholders expanded in the prompt; every bad image refused
with a message naming its part; text-only models refuse images; remote URLs off by default."""

from __future__ import annotations

import base64
import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from frontend_svc.errors import InvalidRequest
from frontend_svc.inputs.input_processor import InputProcessor, load_tokenizer
from frontend_svc.inputs.media import ImageLoader, MediaLimits, parse_limit_mm_per_prompt
from frontend_svc.inputs.model_files import ModelFiles
from frontend_svc.inputs.multimodal import (
    chat_messages,
    load_multimodal_processor,
    template_uses_content_parts,
)
from frontend_svc.openai.protocol import RequestLimits, parse_chat
from frontend_svc.requests import ChatTurn, ContentPart, GenerateInput, ImageInput, PromptInput
from splitserve_contracts.mm_features import feature_identifier
from splitserve_contracts.sampling_rules import Limits
from splitserve_contracts.sampling_types import SamplingParams
from tests.fixtures.llava_checkpoint import (
    IMAGE_TOKEN,
    NUM_IMAGE_TOKENS,
    plain_png,
    png_bytes,
    png_header,
)

LIMITS = MediaLimits(max_images_per_prompt=2, max_image_bytes=20_000, max_image_pixels=64 * 64)


@pytest.fixture(scope="module")
def llava_dir(llava_model_dir: Path) -> Path:
    return llava_model_dir


@pytest.fixture(scope="module")
def mm_inputs(llava_dir: Path) -> InputProcessor:
    tokenizer = load_tokenizer(str(llava_dir))
    multimodal = load_multimodal_processor(llava_dir, tokenizer, LIMITS, NUM_IMAGE_TOKENS)
    return InputProcessor(tokenizer, 256, Limits(vocab_size=len(tokenizer)), multimodal=multimodal)


def png_part(seed: int, where: str = "img", size: tuple[int, int] = (40, 48)) -> ContentPart:
    return ContentPart(image=ImageInput(where, png_bytes(seed, size), "image/png"))


def chat(*parts: ContentPart) -> GenerateInput:
    turn = ChatTurn("user", "", (*parts, ContentPart(text="what is it?")))
    return GenerateInput("r", PromptInput(chat=(turn,)), SamplingParams(max_tokens=4))


def test_images_become_placeholders_with_hashes(mm_inputs: InputProcessor) -> None:
    request = mm_inputs.process(chat(png_part(1), png_part(2)))
    assert mm_inputs.multimodal is not None
    image_id = mm_inputs.multimodal.spec.image_token_id
    ids = request.prompt_token_ids
    assert [f.length for f in request.mm_features] == [NUM_IMAGE_TOKENS] * 2
    for feature in request.mm_features:
        span = ids[feature.offset : feature.offset + feature.length]
        assert span == [image_id] * NUM_IMAGE_TOKENS
        assert feature.shape == (3, 32, 32) and len(feature.data) == 3 * 32 * 32 * 4
        assert feature.identifier == feature_identifier("float32", feature.shape, feature.data)
    assert ids.count(image_id) == 2 * NUM_IMAGE_TOKENS
    first, second = request.mm_features
    assert first.identifier != second.identifier
    again = mm_inputs.process(chat(png_part(1)))
    assert again.mm_features[0].identifier == first.identifier


def test_a_data_url_is_the_same_image(mm_inputs: InputProcessor) -> None:
    url = "data:image/png;base64," + base64.b64encode(png_bytes(1)).decode()
    by_url = mm_inputs.process(chat(ContentPart(image=ImageInput("u", url=url))))
    by_bytes = mm_inputs.process(chat(png_part(1)))
    assert by_url.mm_features == by_bytes.mm_features
    assert by_url.prompt_token_ids == by_bytes.prompt_token_ids


def _image(where: str, **kwargs: Any) -> ContentPart:
    return ContentPart(image=ImageInput(where, **kwargs))


@pytest.mark.parametrize(
    "parts, words",
    [
        ([_image("p0", data=b"\x89PNG\r\n\x1a\n...", mime_type="image/png")], "not a valid"),
        ([_image("p0", data=png_bytes(1), mime_type="application/pdf")], "MIME type"),
        ([_image("p0", data=png_bytes(1))], "set mime_type"),
        ([png_part(1, "a"), png_part(2, "b"), png_part(3, "p0")], "3 images"),
        ([png_part(1, "p0", (80, 80))], "80x80"),
        ([_image("p0", data=b"\0" * 30_000, mime_type="image/png")], "--max-image-bytes"),
        ([_image("p0", url="data:image/png;base64,@@@")], "not valid base64"),
        ([_image("p0", url="data:image/png,raw")], "data:image/png;base64"),
        ([_image("p0", url="file:///etc/passwd")], "scheme 'file'"),
        ([_image("p0", url="http://example.com/a.png")], "remote image URLs are disabled"),
    ],
    ids=[
        "corrupt",
        "mime",
        "no-mime",
        "too-many",
        "too-many-pixels",
        "too-many-bytes",
        "bad-base64",
        "not-base64",
        "file-url",
        "remote",
    ],
)
def test_bad_images_are_refused_naming_the_part(
    mm_inputs: InputProcessor, parts: list[ContentPart], words: str
) -> None:
    with pytest.raises(InvalidRequest) as err:
        mm_inputs.process(chat(*parts))
    assert err.value.param == "p0" and "p0" in str(err.value)
    assert words in str(err.value)


def _png_url(data: bytes, scheme: str = "data", mime_type: str = "image/png") -> str:
    return f"{scheme}:{mime_type};base64," + base64.b64encode(data).decode()


@pytest.mark.parametrize(
    "size, words",
    [
        # Issue 22 row 11: Pillow's decompression-bomb guard refused it as "not a valid image/png".
        ((30000, 30000), "30000x30000 pixels: more than the 16777216 allowed (--max-image-pixels)"),
        # Issue 22 row 2: 1,250 bytes, 300,000 pixels; resized to 32 x 9,600,000 it took 3 GB.
        ((1, 300_000), "1x300000 pixels: a side longer than the 16384 allowed (--max-image-side)"),
        ((10_000, 20), "10000x20 pixels: an aspect ratio of 500:1, more than the 200:1 allowed"),
    ],
    ids=["too-many-pixels", "too-long-a-side", "too-thin"],
)
def test_image_sizes_are_checked_from_the_header(size: tuple[int, int], words: str) -> None:
    loader = ImageLoader(MediaLimits())
    with pytest.raises(InvalidRequest) as err:
        loader.load(ImageInput("p0", png_header(size), "image/png"))
    assert err.value.param == "p0" and f"p0: the image is {words}" in str(err.value)


def test_the_limits_themselves_are_allowed() -> None:
    loader = ImageLoader(MediaLimits())
    for size in ((200, 1), (1, 200), (16384, 82)):
        assert loader.load(ImageInput("p0", plain_png(size), "image/png")).size == size


def test_url_schemes_are_case_insensitive(mm_inputs: InputProcessor) -> None:
    """Issue 22 row 11: `HTTP://` was refused as scheme 'HTTP'."""
    for url in ("HTTP://example.com/a.png", "Https://example.com/a.png"):
        with pytest.raises(InvalidRequest, match="remote image URLs are disabled"):
            mm_inputs.process(chat(_image("p0", url=url)))
    by_bytes = mm_inputs.process(chat(png_part(1)))
    for url in (_png_url(png_bytes(1), "DATA"), _png_url(png_bytes(1), "Data", "IMAGE/PNG")):
        by_url = mm_inputs.process(chat(_image("u", url=url)))
        assert by_url.mm_features == by_bytes.mm_features


def test_images_are_decoded_a_few_at_a_time(llava_dir: Path) -> None:
    """Issue 22 row 2: decoding and resizing run on --mm-processor-threads threads whatever
    the number of callers (each image can take hundreds of MB while it is resized)."""
    tokenizer = load_tokenizer(str(llava_dir))
    limits = MediaLimits(mm_processor_threads=2)
    processor = load_multimodal_processor(llava_dir, tokenizer, limits, NUM_IMAGE_TOKENS)
    lock, active, peak = threading.Lock(), [0], [0]
    pixel_values = processor._pixel_values

    def counted(image: Any) -> Any:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.05)
        try:
            return pixel_values(image)
        finally:
            with lock:
                active[0] -= 1

    processor._pixel_values = counted  # type: ignore[method-assign]
    images = [png_part(i, f"p{i}").image for i in range(16)]
    with ThreadPoolExecutor(8) as callers:
        done = list(callers.map(lambda image: processor.process_images([image]), images))
    assert [p.where for (p,) in done] == [f"p{i}" for i in range(16)]
    assert peak[0] == 2


def test_placeholders_without_images_are_refused(mm_inputs: InputProcessor) -> None:
    typed = GenerateInput("r", PromptInput(text=f"look {IMAGE_TOKEN} here"), SamplingParams())
    with pytest.raises(InvalidRequest, match="1 image placeholders"):
        mm_inputs.process(typed)
    assert mm_inputs.multimodal is not None
    ids = (1, 2, mm_inputs.multimodal.spec.image_token_id)
    with pytest.raises(InvalidRequest, match="but 0 images"):
        mm_inputs.process(GenerateInput("r", PromptInput(token_ids=ids), SamplingParams()))


def test_text_only_prompts_work_on_a_multimodal_model(mm_inputs: InputProcessor) -> None:
    request = mm_inputs.process(chat())
    assert request.mm_features == () and request.prompt_token_ids


def test_a_text_only_model_refuses_images_clearly(tokenizer: Any) -> None:
    inputs = InputProcessor(tokenizer, 64, Limits(vocab_size=len(tokenizer)))
    with pytest.raises(InvalidRequest) as err:
        inputs.process(chat(png_part(1, "chat.messages[0].content_parts[0].image")))
    assert "takes text only" in str(err.value)
    assert err.value.param == "chat.messages[0].content_parts[0].image"
    assert inputs.process(chat()).mm_features == ()


def test_part_templates_get_image_parts_and_string_templates_placeholders() -> None:
    llava_hf = (
        "{% for message in messages %}{% for content in message['content'] | "
        "selectattr('type', 'equalto', 'image') %}<image>\n{% endfor %}{% endfor %}"
    )
    assert template_uses_content_parts(llava_hf)
    assert not template_uses_content_parts("{{ message['content'] }}")
    turn = ChatTurn("user", "", (png_part(1), ContentPart(text="hi")))
    assert chat_messages([turn], "<image>", True)[0]["content"] == [
        {"type": "image"},
        {"type": "text", "text": "hi"},
    ]
    assert chat_messages([turn], "<image>", False)[0]["content"] == "<image>\nhi"


def test_openai_image_url_parts_name_their_place() -> None:
    body = {
        "messages": [
            {"role": "user", "content": "hello"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            },
        ]
    }
    turns = parse_chat(body, RequestLimits(Limits(vocab_size=32))).prompt.chat
    assert turns is not None and turns[0].content == "hello"
    (image,) = turns[1].images
    assert image.where == "messages[1].content[1].image_url" and image.url is not None


def test_limit_mm_per_prompt_takes_vllm_forms() -> None:
    assert parse_limit_mm_per_prompt('{"image": 3}') == 3
    assert parse_limit_mm_per_prompt("image=5") == 5
    with pytest.raises(ValueError, match="only modality"):
        parse_limit_mm_per_prompt('{"video": 1}')


def test_processed_pixels_are_what_transformers_makes(llava_dir: Path) -> None:
    from PIL import Image
    from transformers import AutoImageProcessor

    tokenizer = load_tokenizer(str(llava_dir))
    processor = load_multimodal_processor(llava_dir, tokenizer, LIMITS, NUM_IMAGE_TOKENS)
    (processed,) = processor.process_images([png_part(4).image])  # type: ignore[list-item]
    reference = AutoImageProcessor.from_pretrained(str(llava_dir), backend="pil")
    import io

    image = Image.open(io.BytesIO(png_bytes(4))).convert("RGB")
    expected = reference(images=[image], return_tensors="np")["pixel_values"][0]
    np.testing.assert_array_equal(processed.pixel_values, expected)


def test_image_support_is_the_engines_fact(llava_dir: Path, tmp_path: Path) -> None:
    """The frontend reads an image processor only when the engine says the model takes images
    (EngineInfo.max_tokens_per_mm_item), and refuses a folder that disagrees with it."""
    from tests.fixtures.checkpoints import hf_config

    tokenizer = load_tokenizer(str(llava_dir))
    files = ModelFiles(tokenizer, (), {}, llava_dir, LIMITS)
    assert files.multimodal_processor(0) is None
    processor = files.multimodal_processor(NUM_IMAGE_TOKENS)
    assert processor is not None and processor.spec.num_image_tokens == NUM_IMAGE_TOKENS
    with pytest.raises(ValueError, match="serve the same model on both"):
        files.multimodal_processor(NUM_IMAGE_TOKENS + 1)
    hf_config("llama", architectures=["LlamaForCausalLM"]).save_pretrained(str(tmp_path))
    text_only = ModelFiles(tokenizer, (), {}, tmp_path, LIMITS)
    with pytest.raises(ValueError, match="names no image token"):
        text_only.multimodal_processor(NUM_IMAGE_TOKENS)
    with pytest.raises(ValueError, match="GGUF"):
        ModelFiles(tokenizer, (), {}, None, LIMITS).multimodal_processor(NUM_IMAGE_TOKENS)


def test_dynamic_resolution_images_carry_their_grid_from_the_checkpoints_processor(
    qwen2_5_vl_model_dir: Path,
) -> None:
    """Qwen2.5-VL: each image's patches and grid are what transformers' processor makes of it;
    its placeholders are grid / merge^2; the grid is part of the identifier."""
    from transformers import AutoImageProcessor

    from tests.fixtures.qwen2_5_vl_checkpoint import MERGE_SIZE, qwen_prompt

    images = [png_bytes(1, (32, 24)), png_bytes(2, (40, 24))]
    ids, features, reference = qwen_prompt(qwen2_5_vl_model_dir, "hi", images)
    hf = AutoImageProcessor.from_pretrained(str(qwen2_5_vl_model_dir), backend="pil")
    from PIL import Image

    pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
    expected = hf(images=pictures, return_tensors="np")
    assert [f.grid_thw for f in features] == [tuple(g) for g in expected["image_grid_thw"]]
    assert np.array_equal(reference["pixel_values"].numpy(), expected["pixel_values"])
    assert [f.length for f in features] == [
        int(np.prod(g)) // MERGE_SIZE**2 for g in expected["image_grid_thw"]
    ]
    for f in features:
        assert f.identifier == feature_identifier(f.dtype, f.shape, f.data, f.grid_thw)
        assert f.identifier != feature_identifier(f.dtype, f.shape, f.data)

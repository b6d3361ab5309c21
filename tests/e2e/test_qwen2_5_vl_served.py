"""Qwen2.5-VL served end to end by `splitserve serve FOLDER` (its own process, as an operator
starts it) to the official `openai` SDK: a chat with two `image_url` data: URLs of different sizes
and text after them gets transformers' greedy answer; a video part is refused with a 400 that
names it."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from tests.fixtures.llava_checkpoint import png_bytes
from tests.fixtures.parity import reference_generate
from tests.fixtures.qwen2_5_vl_checkpoint import load_qwen2_5_vl_reference, qwen_prompt
from tests.fixtures.serve_cli import serving

pytestmark = pytest.mark.slow

QUESTION = "what differs between them?"
MAX_TOKENS = 6
IMAGES = [png_bytes(5, (32, 24)), png_bytes(6, (40, 24))]


@pytest.fixture(scope="module")
def served(qwen2_5_vl_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The HTTP base URL of `splitserve serve` on the checkpoint."""
    tmp = tmp_path_factory.mktemp("qwen2_5_vl_serve")
    with serving(qwen2_5_vl_model_dir, tmp, ["--block-size", "8"]) as http:
        yield f"http://{http}/v1"


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_the_sdk_gets_transformers_answer_to_two_images(
    served: str, qwen2_5_vl_model_dir: Path
) -> None:
    path = qwen2_5_vl_model_dir
    ids, _, inputs = qwen_prompt(path, QUESTION, IMAGES)
    expected = reference_generate(load_qwen2_5_vl_reference(path), ids, MAX_TOKENS, **inputs)
    sdk = openai.OpenAI(base_url=served, api_key="unused", max_retries=0)
    parts = [{"type": "image_url", "image_url": {"url": data_url(d)}} for d in IMAGES]
    reply = sdk.chat.completions.create(
        model=sdk.models.list().data[0].id,
        messages=[{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}],  # type: ignore[list-item]
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True, "skip_special_tokens": False},
    )
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=False)


def test_a_video_part_is_refused_by_name(served: str) -> None:
    sdk = openai.OpenAI(base_url=served, api_key="unused", max_retries=0)
    video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(
            model=sdk.models.list().data[0].id,
            messages=[{"role": "user", "content": [video, {"type": "text", "text": "hi"}]}],  # type: ignore[list-item]
            max_tokens=2,
        )
    assert "video_url" in str(info.value)

"""Images end to end on a real stack (worker, core, frontend processes) serving a tiny random
LLaVA: an image question streams over gRPC and over the OpenAI chat endpoint with the tokens
transformers generates; the same image hits the prefix cache (same text) and the encoder cache
(other text); another image with the same text does not hit; text-only requests work; bad
images are refused with INVALID_ARGUMENT naming the part."""

from __future__ import annotations

import base64
import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc
from tests.e2e.client import generate
from tests.e2e.stack import Stack
from tests.fixtures.llava_checkpoint import (
    NUM_IMAGE_TOKENS,
    llava_prompt,
    load_llava_reference,
    plain_png,
    png_bytes,
    png_header,
)
from tests.fixtures.parity import reference_generate

pytestmark = pytest.mark.slow

QUESTION = "what is in the picture?"
MAX_TOKENS = 6
FRONTEND_ENV = {"SPLITSERVE_LIMIT_MM_PER_PROMPT": '{"image": 2}'}


@pytest.fixture(scope="module")
def llava_dir(llava_model_dir: Path) -> Path:
    return llava_model_dir


@pytest.fixture(scope="module")
def mm_stack(llava_dir: Path) -> Iterator[Stack]:
    saved = {k: os.environ.get(k) for k in FRONTEND_ENV}
    os.environ.update(FRONTEND_ENV)
    try:
        stack = Stack(llava_dir, core_flags=["--block-size", "8"]).start()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    yield stack
    stack.stop()


def image_part(data: bytes, mime_type: str = "image/png") -> gen_pb2.ContentPart:
    return gen_pb2.ContentPart(image=gen_pb2.Image(data=data, mime_type=mime_type))


def chat_request(
    parts: list[gen_pb2.ContentPart], system: str | None = None
) -> gen_pb2.GenerateRequest:
    messages = [gen_pb2.ChatMessage(role="system", content=system)] if system else []
    messages.append(gen_pb2.ChatMessage(role="user", content_parts=parts))
    return gen_pb2.GenerateRequest(
        chat=gen_pb2.Chat(messages=messages),
        sampling_params=types_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
    )


def ask(stack: Stack, images: list[bytes], system: str | None = None) -> Any:
    parts = [image_part(data) for data in images] + [gen_pb2.ContentPart(text=QUESTION)]
    return generate(stack.frontend, chat_request(parts, system))[0]


def reference_tokens(llava_dir: Path, images: list[bytes]) -> list[int]:
    ids, _, pixels = llava_prompt(llava_dir, QUESTION, images)
    model = load_llava_reference(llava_dir)
    return reference_generate(model, ids, MAX_TOKENS, pixel_values=pixels)


def test_an_image_question_streams_the_reference_answer_over_grpc(
    mm_stack: Stack, llava_dir: Path
) -> None:
    images = [png_bytes(1), png_bytes(2)]
    with grpc.insecure_channel(mm_stack.frontend) as channel:
        stub = gen_grpc.GenerationServiceStub(channel)
        info = stub.GetModelInfo(gen_pb2.GetModelInfoRequest(), timeout=10)
        parts = [image_part(d) for d in images] + [gen_pb2.ContentPart(text=QUESTION)]
        pieces = list(stub.Generate(chat_request(parts), timeout=120))
    assert info.supports_vision and info.max_images_per_prompt == 2
    assert len(pieces) >= 2  # streamed, not one reply
    tokens = [t for piece in pieces for t in piece.token_ids]
    expected_ids, _, _ = llava_prompt(llava_dir, QUESTION, images)
    assert pieces[-1].usage.prompt_tokens == len(expected_ids)
    assert tokens == reference_tokens(llava_dir, images)


def test_an_image_question_streams_over_the_openai_chat_endpoint(
    mm_stack: Stack, llava_dir: Path
) -> None:
    data = png_bytes(3)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": QUESTION},
                ],
            }
        ],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "stream": True,
    }
    request = urllib.request.Request(
        f"{mm_stack.http}/v1/chat/completions", data=json.dumps(body).encode(), method="POST"
    )
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=120) as reply:
        events = [
            line[6:] for line in reply.read().decode().splitlines() if line.startswith("data: ")
        ]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert len(chunks) >= 2
    over_grpc = ask(mm_stack, [data])
    assert text == over_grpc.text


def test_the_same_image_hits_the_prefix_cache_and_the_encoder_cache(mm_stack: Stack) -> None:
    image = png_bytes(10)
    first = ask(mm_stack, [image])
    before = mm_stack.scheduler_stats()
    again = ask(mm_stack, [image])
    # Same text, same image: the blocks through the image come from the prefix cache.
    assert again.token_ids == first.token_ids
    assert again.usage.cached_tokens >= 7 + NUM_IMAGE_TOKENS - 8
    # Another text before the same image: no prefix hit, but its encoder output is cached.
    other = ask(mm_stack, [image], system="be brief")
    after = mm_stack.scheduler_stats()
    assert other.usage.cached_tokens == 0
    assert after.encoder_cache_queries == before.encoder_cache_queries + 1
    assert after.encoder_cache_hits == before.encoder_cache_hits + 1
    with urllib.request.urlopen(mm_stack.child("core").metrics_url, timeout=10) as reply:
        metrics = reply.read().decode()
    hits = [line for line in metrics.splitlines() if line.startswith("vllm:mm_cache_hits_total{")]
    assert len(hits) == 1 and float(hits[0].split()[-1]) == after.encoder_cache_hits


def test_another_image_with_the_same_text_does_not_hit_the_prefix_cache(mm_stack: Stack) -> None:
    ask(mm_stack, [png_bytes(20)])
    before = mm_stack.scheduler_stats()
    other = ask(mm_stack, [png_bytes(21)])
    after = mm_stack.scheduler_stats()
    assert other.usage.cached_tokens == 0  # block 0 already holds the first placeholder
    assert after.encoder_cache_hits == before.encoder_cache_hits


def test_text_only_requests_work_on_the_multimodal_model(mm_stack: Stack) -> None:
    chat = generate(mm_stack.frontend, chat_request([gen_pb2.ContentPart(text=QUESTION)]))[0]
    plain = generate(
        mm_stack.frontend,
        gen_pb2.GenerateRequest(
            prompt="hello there", sampling_params=types_pb2.SamplingParams(max_tokens=4)
        ),
    )[0]
    assert len(chat.token_ids) == MAX_TOKENS and len(plain.token_ids) == 4


def _png(size: tuple[int, int]) -> bytes:
    return png_bytes(0, size)


@pytest.mark.parametrize(
    "parts, words",
    [
        ([image_part(b"\x89PNG\r\n\x1a\nnot really")], ["content_parts[0].image", "not a valid"]),
        ([image_part(_png((8, 8)))] * 3, ["content_parts[2].image", "3 images", "--limit-mm"]),
        (
            [image_part(png_header((30000, 30000)))],
            ["content_parts[0].image", "30000x30000 pixels", "--max-image-pixels"],
        ),
        (
            [image_part(plain_png((1, 300_000)))],
            ["content_parts[0].image", "1x300000 pixels", "--max-image-side"],
        ),
        (
            [image_part(plain_png((10_000, 20)))],
            ["content_parts[0].image", "aspect ratio of 500:1", "--max-image-aspect-ratio"],
        ),
        ([image_part(_png((8, 8)), "text/plain")], ["content_parts[0].image", "MIME type"]),
        (
            [gen_pb2.ContentPart(image=gen_pb2.Image(url="https://example.com/a.png"))],
            ["content_parts[0].image", "remote image URLs are disabled"],
        ),
        (
            [gen_pb2.ContentPart(image=gen_pb2.Image(url="HTTP://example.com/a.png"))],
            ["content_parts[0].image", "remote image URLs are disabled"],
        ),
    ],
    ids=[
        "corrupt",
        "too-many",
        "too-many-pixels",
        "too-long-a-side",
        "too-thin",
        "wrong-mime",
        "remote-url",
        "remote-url-upper-case",
    ],
)
def test_bad_images_are_invalid_argument_naming_the_part(
    mm_stack: Stack, parts: list[gen_pb2.ContentPart], words: list[str]
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        generate(mm_stack.frontend, chat_request([*parts, gen_pb2.ContentPart(text="hi")]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details() or ""
    assert all(w in details for w in words), details


def _memory_mb(pid: int) -> dict[str, float]:
    """The process's resident set now (VmRSS) and at its peak (VmHWM), in MB."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in lines if line.startswith(("VmRSS", "VmHWM")))
    return {key: int(value.split()[0]) / 1024 for key, value in fields.items()}


def _chat_over_http(stack: Stack, image: bytes) -> tuple[int, str]:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
    request = urllib.request.Request(
        f"{stack.http}/v1/chat/completions", data=json.dumps(body).encode(), method="POST"
    )
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


MEMORY_BOUND_MB = 512
"""What images may add to the frontend's resident set: --mm-processor-threads (2) images at once,
each at most ~240 MB (measured: 16384 x 1024 pixels, --max-image-pixels, take 220 MB to decode
and process; 16384 x 82, the thinnest allowed, 230 MB with LLaVA-1.5's 336-pixel processor)."""


def test_hostile_image_sizes_cost_the_frontend_a_bounded_memory(mm_stack: Stack) -> None:
    """Issue 22 row 2: a 1,250-byte PNG of 1 x 300,000 pixels took the frontend from 0.7 to
    4 GB (a 32 x 9,600,000 resize); it is now refused from its header. Four requests with the
    largest image allowed at once stay within MEMORY_BOUND_MB, and the memory comes back."""
    pid = mm_stack.child("frontend").process.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _memory_mb(pid)
    status, body = _chat_over_http(mm_stack, plain_png((1, 300_000)))
    grown = _memory_mb(pid)["VmHWM"] - before["VmRSS"]
    assert grown < MEMORY_BOUND_MB, f"the frontend grew {grown:.0f} MB for a 1x300000 PNG"
    assert status == 400 and "messages[0].content[0].image_url" in body, body
    assert "1x300000 pixels" in body and "--max-image-side" in body, body
    largest = plain_png((16384, 1024))  # --max-image-pixels, 52 KB of PNG
    with ThreadPoolExecutor(4) as clients:  # as many as the frontend's tokenizer threads
        replies = list(clients.map(lambda _: _chat_over_http(mm_stack, largest), range(4)))
    assert [status for status, _ in replies] == [200] * 4, replies[0]
    after = _memory_mb(pid)
    grown = after["VmHWM"] - before["VmRSS"]
    print(f"frontend RSS {before['VmRSS']:.0f} MB, peak +{grown:.0f}, after {after['VmRSS']:.0f}")
    assert grown < MEMORY_BOUND_MB, f"the frontend grew {grown:.0f} MB for 4 images"
    assert after["VmRSS"] - before["VmRSS"] < 64, after  # given back

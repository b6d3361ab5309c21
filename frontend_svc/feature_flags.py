"""The frontend's flag groups beyond its core ones (config.py): images, the gateway, tools and
reasoning, the public port's security (vLLM's names where vLLM has the flag)."""

from __future__ import annotations

import argparse

from frontend_svc.http_flags import positive_seconds
from frontend_svc.inputs.media import DEFAULT_MEDIA_LIMITS, parse_limit_mm_per_prompt
from frontend_svc.kv_events.kv_events_config import KVEventsConfig, parse_kv_events_config
from frontend_svc.openai.reasoning import REASONING_PARSERS
from frontend_svc.openai.response_store import (
    DEFAULT_RESPONSES_STORE_SIZE,
    DEFAULT_RESPONSES_STORE_TTL,
)
from frontend_svc.openai.tool_parsers import TOOL_PARSERS
from splitserve_runtime.flags import Flag, flag, non_negative_int, positive_int
from splitserve_runtime.listener import DEFAULT_PUBLIC_MAX_RECEIVE_BYTES


def _domains(value: str) -> tuple[str, ...]:
    return tuple(d for d in value.replace(",", " ").split() if d)


def _aspect_ratio(value: str) -> float:
    ratio = float(value)
    if not ratio >= 1.0:  # also NaN
        raise argparse.ArgumentTypeError(f"an aspect ratio is at least 1, got {value}")
    return ratio


MEDIA_FLAGS: tuple[Flag, ...] = (
    flag(
        "--limit-mm-per-prompt",
        type=parse_limit_mm_per_prompt,
        default=DEFAULT_MEDIA_LIMITS.max_images_per_prompt,
        help='most images per request, as JSON {"image": N} (default: 4)',
    ),
    flag(
        "--max-image-bytes",
        type=positive_int,
        default=DEFAULT_MEDIA_LIMITS.max_image_bytes,
        help="largest encoded image a request may send or a URL may serve, in bytes (gRPC "
        "requests are also bounded by --max-receive-message-bytes)",
    ),
    flag(
        "--max-image-pixels",
        type=positive_int,
        default=DEFAULT_MEDIA_LIMITS.max_image_pixels,
        help="largest decoded image, width x height pixels",
    ),
    flag(
        "--max-image-side",
        type=positive_int,
        default=DEFAULT_MEDIA_LIMITS.max_image_side,
        help="longest image width or height, in pixels",
    ),
    flag(
        "--max-image-aspect-ratio",
        type=_aspect_ratio,
        default=DEFAULT_MEDIA_LIMITS.max_image_aspect_ratio,
        help="largest long side / short side of an image (Hugging Face's Qwen2-VL bound): a "
        "processor that resizes the shortest side makes a larger image the thinner the input",
    ),
    flag(
        "--mm-processor-threads",
        type=positive_int,
        default=DEFAULT_MEDIA_LIMITS.mm_processor_threads,
        help="images decoded and processed at once by this frontend (each can take a few "
        "hundred MB while it is resized); more wait their turn",
    ),
    flag(
        "--allowed-media-domains",
        type=_domains,
        default=(),
        help="hosts whose http(s) image URLs the frontend may fetch (space or comma "
        "separated; public addresses only); empty: remote URLs are refused, only inline "
        "images (bytes, data: URLs) are taken",
    ),
    flag(
        "--media-fetch-timeout",
        type=float,
        default=DEFAULT_MEDIA_LIMITS.media_fetch_timeout,
        help="seconds one remote image may take to fetch (vLLM's VLLM_IMAGE_FETCH_TIMEOUT)",
    ),
)
"""Images on multimodal models; vLLM's names where vLLM has the flag."""


GATEWAY_FLAGS: tuple[Flag, ...] = (
    flag(
        "--kv-events-config",
        type=parse_kv_events_config,
        default=KVEventsConfig(),
        help="vLLM's KV-cache events config as JSON, e.g. "
        "'{\"enable_kv_cache_events\": true}': the engine's events are served on the gateway "
        'contract\'s SubscribeKvEvents and, with "publisher": "zmq" (the default once enabled), '
        'published on "endpoint" (default tcp://*:5557) as vLLM does; "publisher": "null" '
        "serves them over gRPC only",
    ),
    flag(
        "--data-parallel-rank",
        "-dpr",
        type=non_negative_int,
        default=0,
        help="this engine's rank among data-parallel engines behind one gateway: its ZMQ "
        "KV-event endpoints are offset by it and its events carry it (vLLM's flag)",
    ),
)
"""What a gateway in front of several engines needs from this one (vLLM's names)."""


TOOLS_AND_REASONING_FLAGS: tuple[Flag, ...] = (
    flag(
        "--enable-auto-tool-choice",
        action="store_true",
        help="let chat requests use tool_choice auto (the default when they send tools): the "
        "model decides, and --tool-call-parser reads its calls from the answer",
    ),
    flag(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="the served model's tool-call format, by vLLM's names: hermes (Hermes, Qwen2.5, "
        "Qwen3), llama3_json / llama4_json (Llama 3.1+, 4), mistral, openai (gpt-oss's harmony "
        "format), pythonic (Llama 3.2, ToolACE), qwen3_xml / qwen3_coder (Qwen3-Coder, Qwen3.5)",
    ),
    flag(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="split the model's thinking (<think>...</think>) into the answer's `reasoning` "
        "field: deepseek_r1 (DeepSeek-R1 and distills), qwen3 (Qwen3, QwQ; honours "
        "chat_template_kwargs.enable_thinking), openai_gptoss (gpt-oss: its harmony `analysis` "
        "channel)",
    ),
    flag(
        "--responses-store-size",
        type=non_negative_int,
        default=DEFAULT_RESPONSES_STORE_SIZE,
        help="/v1/responses: most responses this frontend keeps for previous_response_id and "
        "GET /v1/responses/{id} (store: true; least recently created dropped first; 0: none)",
    ),
    flag(
        "--responses-store-ttl",
        type=positive_seconds,
        default=DEFAULT_RESPONSES_STORE_TTL,
        help="/v1/responses: seconds a stored response is kept",
    ),
)
"""Tool calling, reasoning and the Responses API (vLLM's names where vLLM has the flag)."""


PUBLIC_SECURITY_FLAGS: tuple[Flag, ...] = (
    flag(
        "--api-key",
        default="",
        help="require `authorization: Bearer <key>` on every GenerationService call and on "
        "the HTTP /v1/*, /tokenize and /detokenize routes (health, /ping, /version, metrics "
        "and reflection stay open); also read from "
        "SPLITSERVE_API_KEY or VLLM_API_KEY. Prefer the environment: command lines are "
        "visible to every user of the machine",
    ),
    flag("--ssl-certfile", default="", help="PEM certificate: serve the API over TLS"),
    flag("--ssl-keyfile", default="", help="PEM private key of --ssl-certfile"),
    flag(
        "--ssl-ca-certs",
        default="",
        help="PEM CA bundle: also require client certificates signed by it",
    ),
    flag(
        "--max-receive-message-bytes",
        type=positive_int,
        default=DEFAULT_PUBLIC_MAX_RECEIVE_BYTES,
        help="largest request the public ports accept: a gRPC message, an HTTP body",
    ),
)
"""vLLM's names: --api-key, --ssl-certfile, --ssl-keyfile, --ssl-ca-certs."""

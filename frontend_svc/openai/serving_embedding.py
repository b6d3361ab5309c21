"""POST /v1/embeddings (OpenAI's and vLLM's shape): `input` as a string, a list of strings, token
ids or lists of token ids; `encoding_format` float or base64 (little-endian float32, as the
openai SDK decodes it); `dimensions` for Matryoshka models."""

from __future__ import annotations

import base64
from typing import Any

from frontend_svc.errors import InvalidRequest
from frontend_svc.openai import generation
from frontend_svc.openai.fields import as_bool, as_int, as_str, read
from frontend_svc.openai.generation import ServingContext
from frontend_svc.openai.protocol import PRIORITY, as_client_id, prompt_inputs
from frontend_svc.requests import EngineRequest, derived_request_id
from frontend_svc.serving import pooling

ENCODING_FORMATS = ("float", "base64")
_UNSUPPORTED = ("truncate_prompt_tokens", "messages")
_SERVED_ENCODING = {"embed_dtype": ("float32",), "endianness": ("native", "little")}
"""vLLM's base64 settings and the values splitserve serves (native: little-endian hosts)."""


async def create_embeddings(
    ctx: ServingContext, body: dict[str, Any], header_id: str | None
) -> dict[str, Any]:
    """The reply to one /v1/embeddings body (InvalidRequest names the field at fault)."""
    ctx.check_model(read(body, "model", as_str))
    config = pooling.pooler_config(ctx.info)
    refuse_unsupported(body)
    encoding = encoding_format(body)
    dimensions = read(body, "dimensions", as_int)
    pooling.check_dimensions(config, dimensions, "dimensions")
    rid, requests = await pooling_requests(ctx, body, header_id, "embd", pooling.EMBED_TASK)
    embedded = await pooling.embed_all(ctx.engine, requests, config, dimensions)
    data = [
        {"object": "embedding", "index": i, "embedding": encode(e.vector, encoding)}
        for i, e in enumerate(embedded)
    ]
    num_tokens = sum(e.num_prompt_tokens for e in embedded)
    return list_reply(ctx, rid, data, {"prompt_tokens": num_tokens, "total_tokens": num_tokens})


def list_reply(
    ctx: ServingContext, rid: str, data: list[dict[str, Any]], usage: dict[str, Any]
) -> dict[str, Any]:
    """The pooling endpoints' list envelope (vLLM's): id, object, created, model, data, usage."""
    return {
        "id": rid,
        "object": "list",
        "created": generation.now(),
        "model": ctx.served_model_name,
        "data": data,
        "usage": usage,
    }


def refuse_unsupported(body: dict[str, Any]) -> None:
    """A 400 for the pooling fields splitserve does not serve."""
    for name in _UNSUPPORTED:
        if body.get(name) is not None:
            raise InvalidRequest(f"`{name}` is not supported by splitserve; leave it out", name)


def encoding_format(body: dict[str, Any]) -> str:
    """`encoding_format` (float or base64: little-endian float32 values)."""
    encoding: str = read(body, "encoding_format", as_str, "float")
    if encoding not in ENCODING_FORMATS:
        raise InvalidRequest(
            f"`encoding_format` must be one of {', '.join(ENCODING_FORMATS)}, got "
            f"{encoding[:32]!r}",
            "encoding_format",
        )
    for name, served in _SERVED_ENCODING.items():
        if read(body, name, as_str, served[0]) not in served:
            raise InvalidRequest(
                f"`{name}` must be {' or '.join(served)}: base64 holds little-endian float32",
                name,
            )
    return encoding


async def pooling_requests(
    ctx: ServingContext, body: dict[str, Any], header_id: str | None, prefix: str, task: str
) -> tuple[str, list[EngineRequest]]:
    """The call's request id and one checked, tokenized engine request per `input` (a text,
    texts, token ids or lists of them; at most --max-fan-out)."""
    read(body, "user", as_str)
    priority = read(body, "priority", PRIORITY, 0)
    if body.get("input") is None:
        raise InvalidRequest("`input` is required", "input")
    add_special = read(body, "add_special_tokens", as_bool, True)
    prompts = prompt_inputs(body["input"], add_special, ctx.max_fan_out, "input")
    if header_id is not None:
        as_client_id(header_id, "the x-request-id header")
    rid = generation.request_id(prefix, header_id, read(body, "request_id", as_str))
    requests = [
        await ctx.inputs.run(
            pooling.embed_request,
            ctx.inputs,
            derived_request_id(rid, f"-{i}"),
            p,
            "input",
            priority,
            task,
        )
        for i, p in enumerate(prompts)
    ]
    return rid, requests


def encode(vector: Any, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return [float(v) for v in vector]

"""Server-sent events as OpenAI streams them: `data: {json}\\n\\n` ... `data: [DONE]\\n\\n`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec

from frontend_svc.errors import FrontendError
from frontend_svc.public_errors import bounded, client_message, unexpected_error_message

DONE = "data: [DONE]\n\n"
GRPC_PARAMS = {
    "sampling_params": "",
    "prompt_token_ids": "prompt",
    "chat.messages": "messages",
    "chat": "messages",
}
"""The fields the shared checks (InputProcessor) name as the gRPC API calls them -> the OpenAI
request's names ("" : the part after it is the name)."""


_encode = msgspec.json.Encoder().encode


def sse(body: Any) -> str:
    """One event; compact UTF-8 JSON (msgspec: several times faster than json.dumps per
    chunk, the same text but for float spellings, e.g. 1e-07 vs 1e-7)."""
    return "data: " + _encode(body).decode() + "\n\n"


def http_param(param: str | None) -> str | None:
    """The OpenAI request field for a field named as the gRPC API names it."""
    if param is None:
        return None
    for name, replacement in GRPC_PARAMS.items():
        rest = param[len(name) :]
        if param.startswith(name) and (not rest or rest[0] in ".["):
            return replacement + rest if replacement else rest.lstrip(".")
    return param


def error_body(err: FrontendError, message: str | None = None) -> dict[str, Any]:
    """OpenAI's error object; `code` is the HTTP status, as vLLM sends it. The message is what
    a client may read (public_errors: server-side detail goes to the log under an error id)."""
    return {
        "error": {
            "message": bounded(message if message is not None else client_message(err)),
            "type": err.error_type,
            "param": http_param(err.param),
            "code": err.http_status,
        }
    }


async def guarded(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream that ends with an in-stream error event instead of a cut connection when
    something fails after the status line went out."""
    try:
        async for chunk in chunks:
            yield chunk
    except FrontendError as err:
        yield sse(error_body(err))
        yield DONE
    except Exception:
        yield sse(error_body(FrontendError(), unexpected_error_message("an SSE stream")))
        yield DONE

"""Server-sent events as OpenAI streams them: `data: {json}\\n\\n` ... `data: [DONE]\\n\\n`."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from frontend_svc.errors import FrontendError

logger = logging.getLogger(__name__)
DONE = "data: [DONE]\n\n"


def sse(body: Any) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


def error_body(err: FrontendError) -> dict[str, Any]:
    """OpenAI's error object; `code` is the HTTP status, as vLLM sends it."""
    return {
        "error": {
            "message": str(err),
            "type": err.error_type,
            "param": err.param,
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
        logger.exception("an SSE stream failed")
        yield sse(error_body(FrontendError("internal error while streaming; retry the request")))
        yield DONE

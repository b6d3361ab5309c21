"""vLLM's kv_transfer_params on the frontend (prefill/decode disaggregation, docs/deploy.md).

Accepted only from callers of an engine with a KV connector (--kv-transfer-config); without one
they stay refused by name. The frontend checks the shape (a JSON object of at most
MAX_PARAMS_BYTES) and passes the text through to the engine core, whose connector validates the
keys; a finished request's params (a producer's handoff) come back on its final delta. One
handoff belongs to one engine request: a call that would fan out (n > 1, several prompts) with
params is refused rather than sending the same handoff to several requests.
"""

from __future__ import annotations

import json
from typing import Any

from frontend_svc.engine.engine_types import EngineInfo
from frontend_svc.errors import InvalidRequest

MAX_PARAMS_BYTES = 64 * 1024
NO_CONNECTOR = (
    "prefill/decode disaggregation (KV transfer) needs an engine with a KV connector; "
    "start it with --kv-transfer-config, or send the request without it"
)


def has_kv_connector(info: EngineInfo) -> bool:
    """Whether the engine was started with a KV connector (--kv-transfer-config)."""
    kv = info.options.kv_transfer
    return kv is not None and bool(kv.kv_connector)


def _checked_size(text: str, field: str) -> str:
    size = len(text.encode())
    if size > MAX_PARAMS_BYTES:
        raise InvalidRequest(f"{field} is {size} bytes; at most {MAX_PARAMS_BYTES}", field)
    return text


def params_json_from_text(text: str, field: str) -> str:
    """A caller's kv_transfer_params as JSON text, checked to be one object within the size
    limit; returned verbatim (the connector reads its keys)."""
    _checked_size(text, field)
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        raise InvalidRequest(f"{field} is not valid JSON; send a JSON object", field) from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{field} must be a JSON object, got {type(value).__name__}", field)
    return text


def params_json_from_object(value: Any, field: str) -> str:
    """An HTTP body's `kv_transfer_params` (a JSON object) as the text the core takes."""
    if not isinstance(value, dict):
        raise InvalidRequest(f"`{field}` must be an object, got {type(value).__name__}", field)
    return _checked_size(json.dumps(value, separators=(",", ":")), field)


def check_one_request(num_requests: int, field: str) -> None:
    """Refuse params on a call that fans out into several engine requests."""
    if num_requests > 1:
        raise InvalidRequest(
            f"{field} hands one request's KV over; this call would make {num_requests} engine "
            "requests (n > 1 or several prompts): send one prompt with n = 1",
            field,
        )


def params_from_json(text: str) -> dict[str, Any] | None:
    """A finished request's params (the core's JSON object) for an HTTP response; None when
    there are none (or the core's text is not an object)."""
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None

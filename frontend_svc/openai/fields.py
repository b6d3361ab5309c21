"""JSON request values to Python values, each refusal a 400 that names the field.

A coercer takes the JSON value and the field's name and returns the value or raises
InvalidRequest. JSON null never reaches a coercer: a null field counts as absent (guidellm sends
`"stop": null`). `coercer_for` picks the coercer of a dataclass field from its type hint, which is
what lets the SamplingParams mapping be driven by the contract's own field list.
"""

from __future__ import annotations

import json
import math
import struct
import types
from collections.abc import Callable
from typing import Any, Union, get_args, get_origin

from starlette.requests import Request

from frontend_svc.errors import InvalidRequest

MAX_BODY_BYTES = 64 * 1024 * 1024
Coerce = Callable[[Any, str], Any]


def _wrong(name: str, expected: str, value: Any) -> InvalidRequest:
    return InvalidRequest(f"`{name}` must be {expected}, got {type(value).__name__}", name)


def _reject_constant(text: str) -> Any:
    raise InvalidRequest(f"the body holds {text}, which is not a JSON number; send finite numbers")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object (strict: no NaN or Infinity)."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"the body must be a JSON object, got {type(body).__name__}")
    return body


async def read_json(request: Request) -> dict[str, Any]:
    """The request's body as a JSON object, refused past MAX_BODY_BYTES: by its Content-Length,
    and while it arrives (a chunked body announces no length)."""
    too_big = InvalidRequest(f"the body is over {MAX_BODY_BYTES} bytes (or its length is bad)")
    size = request.headers.get("content-length")
    if size is not None and (not size.isdigit() or int(size) > MAX_BODY_BYTES):
        raise too_big
    chunks, num_bytes = [], 0
    async for chunk in request.stream():
        num_bytes += len(chunk)
        if num_bytes > MAX_BODY_BYTES:
            raise too_big
        chunks.append(chunk)
    return parse_json_object(b"".join(chunks))


def as_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise _wrong(name, "true or false", value)
    return value


def as_int(value: Any, name: str) -> int:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _wrong(name, "an integer", value)
    return value


def as_float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _wrong(name, "a number", value)
    if not math.isfinite(value):
        raise InvalidRequest(f"`{name}` must be a finite number", name)
    return as_float32(value, name)


def as_float32(value: float, name: str) -> float:
    """`value` as the contract carries it (a 32-bit float), so the checks see what the engine
    gets: 1e-130 is 0.0 there, and 1e39 does not fit."""
    (rounded,) = struct.unpack("f", struct.pack("f", value))
    if not math.isfinite(rounded):
        raise InvalidRequest(f"`{name}` is too large ({value:g}; the largest is 3.4e38)", name)
    return float(rounded)


def as_str(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise _wrong(name, "a string", value)
    return value


def as_object(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _wrong(name, "an object", value)
    return value


def as_list(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise _wrong(name, "a list", value)
    return value


def as_str_tuple(value: Any, name: str) -> tuple[str, ...]:
    """A string or a list of strings (OpenAI's `stop`)."""
    if isinstance(value, str):
        return (value,)
    return tuple(as_str(v, name) for v in as_list(value, name))


def as_int_tuple(value: Any, name: str) -> tuple[int, ...]:
    return tuple(as_int(v, name) for v in as_list(value, name))


def as_float_by_int(value: Any, name: str) -> dict[int, float]:
    """An object whose keys are integers in JSON text (OpenAI's `logit_bias`)."""
    out: dict[int, float] = {}
    for key, v in as_object(value, name).items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidRequest(f"`{name}` keys must be token ids, got {key!r}", name) from None
        out[token_id] = as_float(v, name)
    return out


def _hint_key(hint: Any) -> Any:
    """int | None -> int; tuple[str, ...] -> (tuple, str); dict[int, float] -> (dict, int, float)."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        (inner,) = (a for a in get_args(hint) if a is not type(None))
        return _hint_key(inner)
    if origin is tuple:
        return (tuple, get_args(hint)[0])
    if origin is dict:
        return (dict, *get_args(hint))
    return hint


COERCERS_BY_HINT: dict[Any, Coerce] = {
    bool: as_bool,
    int: as_int,
    float: as_float,
    str: as_str,
    (tuple, str): as_str_tuple,
    (tuple, int): as_int_tuple,
    (dict, int, float): as_float_by_int,
}


def coercer_for(hint: Any) -> Coerce:
    """The coercer for a dataclass field's type hint; KeyError names a type with none yet."""
    return COERCERS_BY_HINT[_hint_key(hint)]


def read(body: dict[str, Any], name: str, coerce: Coerce, default: Any = None) -> Any:
    """`body[name]` coerced, or `default` when the field is absent or null."""
    value = body.get(name)
    return default if value is None else coerce(value, name)

"""JSON request values to Python values, each refusal a 400 that names the field (a body over
the size limit: 413).

A coercer takes the JSON value and the field's name and returns the value or raises
InvalidRequest. JSON null never reaches a coercer: a null field counts as absent (guidellm sends
`"stop": null`). `coercer_for` picks the coercer of a dataclass field from its type hint, which is
what lets the SamplingParams mapping be driven by the contract's own field list.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import struct
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, Union, get_args, get_origin

import msgspec
from starlette.requests import Request

from frontend_svc.errors import BodyTooLarge, InvalidRequest, shorten
from splitserve_runtime.listener import DEFAULT_PUBLIC_MAX_RECEIVE_BYTES

DEFAULT_MAX_BODY_BYTES = DEFAULT_PUBLIC_MAX_RECEIVE_BYTES
"""The largest body, as the gRPC port's largest message (--max-receive-message-bytes)."""
_DECODER = msgspec.json.Decoder()
SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
"""A JSON escape of a UTF-16 surrogate, or a surrogate encoded as UTF-8 bytes (which json.loads
lets through): a lone one decodes to a str no UTF-8 can carry."""
Coerce = Callable[[Any, str], Any]


def _wrong(name: str, expected: str, value: Any) -> InvalidRequest:
    return InvalidRequest(f"`{name}` must be {expected}, got {type(value).__name__}", name)


def _reject_constant(text: str) -> Any:
    raise InvalidRequest(f"the body holds {text}, which is not a JSON number; send finite numbers")


class _HugeInt:
    """Stands for an integer literal longer than Python converts (sys.get_int_max_str_digits()),
    so that the field holding it can be found."""


def _int_or_huge(text: str) -> int | _HugeInt:
    return _HugeInt() if len(text.lstrip("-")) > sys.get_int_max_str_digits() else int(text)


def _has_lone_surrogate(value: Any) -> bool:
    if not isinstance(value, str) or value.isascii():
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return True
    return False


def _leaves(value: Any) -> Iterator[Any]:
    """Every value, key and container under `value` (iterative: nesting depth costs no stack)."""
    stack = [value]
    while stack:
        item = stack.pop()
        yield item
        if isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _field_holding(body: dict[str, Any], is_bad: Callable[[Any], bool]) -> str | None:
    """The first top-level field whose key or value holds something `is_bad`."""
    for key, value in body.items():
        if is_bad(key) or any(is_bad(item) for item in _leaves(value)):
            return shorten(key.encode(errors="backslashreplace").decode())
    return None


def _refuse_huge_ints(raw: bytes) -> NoReturn:
    body = json.loads(raw, parse_constant=_reject_constant, parse_int=_int_or_huge)
    name = None
    if isinstance(body, dict):
        name = _field_holding(body, lambda value: isinstance(value, _HugeInt))
    limit = sys.get_int_max_str_digits()
    where = f"`{name}` holds" if name else "the body holds"
    raise InvalidRequest(
        f"{where} an integer of more than {limit} digits; no field takes one", name
    )


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object (strict: no NaN or Infinity). Refused with the field
    named: an integer too long to convert, text with a lone UTF-16 surrogate (no UTF-8 carries
    it: the tokenizer and the reply could not).

    msgspec decodes it (several times faster than json.loads): it refuses everything the checks
    below refuse (NaN and Infinity, integers past Python's digit limit, lone surrogates, bad
    UTF-8), so a body it takes needs no further check; one it refuses (or only json.loads reads,
    e.g. UTF-16) goes through json.loads and the checks, which say what is wrong and where."""
    try:
        body = _DECODER.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return _parse_checked(raw)
    if not isinstance(body, dict):
        raise InvalidRequest(f"the body must be a JSON object, got {type(body).__name__}")
    return body


def _parse_checked(raw: bytes) -> dict[str, Any]:
    """json.loads with the checks that name the offending field."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from None
    except ValueError:  # an integer past Python's digit limit
        _refuse_huge_ints(raw)
    if not isinstance(body, dict):
        raise InvalidRequest(f"the body must be a JSON object, got {type(body).__name__}")
    if SURROGATE.search(raw):
        name = _field_holding(body, _has_lone_surrogate)
        if name is not None:
            raise InvalidRequest(
                f"`{name}` holds text with a lone UTF-16 surrogate (an unpaired U+D800..U+DFFF), "
                "which is not Unicode text; send valid text",
                name,
            )
    return body


PARSE_ON_LOOP_BYTES = 64 * 1024
"""Bodies from this size on are parsed on a thread: a 4 MiB body takes the parser tens of ms
(more on a busy machine), which the event loop serving every stream must not wait for."""


async def read_json(request: Request, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> dict[str, Any]:
    """The request's body as a JSON object, refused (413) past `max_bytes`: by its
    Content-Length, and while it arrives (a chunked body announces no length). The HTTP server
    refuses such a body before the app sees it (http_limits.py, which also reads the rest of it
    so that the client gets the 413); this bounds what the app holds under any server."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > max_bytes:
        raise BodyTooLarge(max_bytes)
    chunks, num_bytes = [], 0
    async for chunk in request.stream():
        num_bytes += len(chunk)
        if num_bytes > max_bytes:
            raise BodyTooLarge(max_bytes)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if num_bytes < PARSE_ON_LOOP_BYTES:
        return parse_json_object(raw)
    return await asyncio.to_thread(parse_json_object, raw)


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
    try:
        number = float(value)
    except OverflowError:  # an integer past any float
        raise InvalidRequest(f"`{name}` is too large (the largest is 3.4e38)", name) from None
    if not math.isfinite(number):
        raise InvalidRequest(f"`{name}` must be a finite number", name)
    return as_float32(number, name)


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


TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,20}")
"""A logit_bias key: a token id in decimal (20 digits hold any 64-bit value)."""


def as_float_by_int(value: Any, name: str) -> dict[int, float]:
    """An object whose keys are integers in JSON text (OpenAI's `logit_bias`)."""
    out: dict[int, float] = {}
    for key, v in as_object(value, name).items():
        if not TOKEN_ID_KEY.fullmatch(key):
            raise InvalidRequest(f"`{name}` keys must be token ids, got {shorten(key)!r}", name)
        out[int(key)] = as_float(v, name)
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


def as_int_within(lo: int, hi: int) -> Coerce:
    """An integer in [lo, hi] (a contract field's wire range)."""

    def coerce(value: Any, name: str) -> int:
        number = as_int(value, name)
        if not lo <= number <= hi:
            raise InvalidRequest(f"`{name}` must be in [{lo}, {hi}]", name)
        return number

    return coerce


def read(
    body: dict[str, Any], name: str, coerce: Coerce, default: Any = None, where: str = ""
) -> Any:
    """`body[name]` coerced, or `default` when the field is absent or null; a refusal names
    `where.name` (`where`: the object's own place in the request, if nested)."""
    value = body.get(name)
    return default if value is None else coerce(value, f"{where}.{name}" if where else name)

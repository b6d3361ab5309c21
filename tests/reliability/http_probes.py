"""What every HTTP reliability case checks once it has run: the reply is OpenAI's error JSON
(`message`, `type`, `param`, `code` = the status) with no Python internals and no echo of a huge
input, the frontend still serves an HTTP request, and nothing leaked (probes.wait_idle)."""

from __future__ import annotations

import contextlib
import http.client
import json
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlparse

from tests.e2e.stack import Stack
from tests.reliability.http_cases import HttpCase
from tests.reliability.probes import PYTHON_INTERNALS, wait_idle

MAX_MESSAGE_CHARS = 2048
"""No refusal echoes a client's huge input back."""
MIB = 1024 * 1024
ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
}
"""OpenAI's error `type` of each status."""


def http_call(
    base: str,
    method: str,
    path: str,
    body: bytes | Iterator[bytes] | None,
    headers: Mapping[str, str] | None = None,
    timeout: float = 120,
) -> tuple[int, Any, http.client.HTTPResponse]:
    """(status, JSON reply or text, response) of one call; an iterator body goes chunked,
    without a length. The server may answer before a long body is all sent."""
    url = urlparse(base)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=timeout)
    try:
        all_headers = {"Content-Type": "application/json", **(headers or {})}
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            is_chunked = body is not None and not isinstance(body, bytes)
            conn.request(method, path, body, all_headers, encode_chunked=is_chunked)
        reply = conn.getresponse()
        raw = reply.read()
    finally:
        conn.close()
    try:
        return reply.status, json.loads(raw), reply
    except json.JSONDecodeError:
        return reply.status, raw.decode(errors="replace"), reply


def post_json(base: str, path: str, body: Any, timeout: float = 120) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, reply, _ = http_call(base, "POST", path, data, timeout=timeout)
    return status, reply


def assert_openai_error(reply: Any, status: int) -> dict[str, Any]:
    """The error object of a refusal, checked for OpenAI's shape and a message fit to show."""
    assert isinstance(reply, dict) and set(reply) == {"error"}, reply
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == status and isinstance(error["message"], str) and error["message"]
    assert len(error["message"]) <= MAX_MESSAGE_CHARS, error["message"][:200]
    leaked = [f for f in PYTHON_INTERNALS if f in error["message"]]
    assert not leaked, f"{error['message']!r} shows {leaked}"
    assert error["param"] is None or isinstance(error["param"], str)
    return dict(error)


def assert_http_serving_and_idle(stack: Stack) -> None:
    """A normal HTTP completion still completes, every process is alive, the engine drains."""
    for child in stack.children:
        assert child.process.poll() is None, f"{child.name} died"
    status, reply = post_json(stack.http, "/v1/completions", {"prompt": "canary", "max_tokens": 2})
    assert status == 200 and reply["choices"][0]["finish_reason"], reply
    wait_idle(stack)


def chunked(num_bytes: int) -> Iterator[bytes]:
    """A completions body of `num_bytes` prompt bytes, sent in 1 MiB chunks."""
    yield b'{"prompt": "'
    for _ in range(num_bytes // MIB):
        yield b"a" * MIB
    yield b'", "max_tokens": 1}'


def case_body(case: HttpCase) -> bytes | None:
    """A case's body as sent: bytes as they are, any other value as JSON."""
    if case.body is None or isinstance(case.body, bytes):
        return case.body
    return json.dumps(case.body).encode()


def assert_refused_and_serving(
    stack: Stack, case: HttpCase, body: bytes | Iterator[bytes] | None
) -> None:
    """`case` sent with `body` gets its status and OpenAI's error naming its field; then the
    stack still serves and nothing leaked."""
    status, reply, _ = http_call(stack.http, case.method, case.path, body, case.headers)
    assert status == case.status, reply
    error = assert_openai_error(reply, status)
    assert case.fragment in error["message"], error["message"]
    assert error["param"] == case.param, error
    assert error["type"] == ERROR_TYPES[status]
    assert_http_serving_and_idle(stack)

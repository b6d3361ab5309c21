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
from tests.reliability.probes import PYTHON_INTERNALS, wait_idle

MAX_MESSAGE_CHARS = 2048
"""No refusal echoes a client's huge input back."""
MIB = 1024 * 1024


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

"""A body over --max-receive-message-bytes (issue 37): 413 with OpenAI's error JSON, on any route,
read by every kind of client. On main it was a 400 after which the server closed with the rest of
the body unread: clients that read once they have sent everything (Python's urllib, which also
asks for `Connection: close`) got a reset or a broken pipe instead of any status. Now the server
answers at once (by the Content-Length, or once a chunked body passes the limit) and reads and
drops the rest of the body, up to http_limits.MAX_DRAIN_BYTES more, before it closes."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, BinaryIO

import aiohttp
import httpx
import openai
import pytest

from frontend_svc.openai.http_limits import MAX_DRAIN_BYTES
from tests.e2e.stack import Stack
from tests.reliability.http_cases import DETOKENIZE, MAX_BODY_BYTES, TOKENIZE
from tests.reliability.http_probes import MIB, assert_http_serving_and_idle, assert_openai_error

pytestmark = pytest.mark.slow
BODY = b'{"tokens": [' + b"5, " * (3 * MIB) + b"5]}"
"""A 9 MiB /detokenize body (the issue's)."""
JSON = {"Content-Type": "application/json"}
Reply = tuple[int, bytes]
"""A client's status and body."""


def pieces(body: bytes, size: int = 256 * 1024) -> Iterator[bytes]:
    """`body` as an iterator: urllib, httpx and aiohttp send it chunked, with no length."""
    for start in range(0, len(body), size):
        yield body[start : start + size]


def with_urllib(url: str, body: bytes, chunked: bool) -> Reply:
    data: Any = pieces(body) if chunked else body
    request = urllib.request.Request(url, data=data, headers=JSON)
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def with_httpx(url: str, body: bytes, chunked: bool) -> Reply:
    reply = httpx.post(url, content=pieces(body) if chunked else body, headers=JSON, timeout=60)
    return reply.status_code, reply.content


def with_aiohttp(url: str, body: bytes, chunked: bool) -> Reply:
    async def stream() -> AsyncIterator[bytes]:
        for piece in pieces(body):
            yield piece

    async def post() -> Reply:
        async with aiohttp.ClientSession() as session:
            data = stream() if chunked else body
            async with session.post(url, data=data, headers=JSON) as reply:
                return reply.status, await reply.read()

    return asyncio.run(post())


def with_curl(url: str, body: bytes, chunked: bool) -> Reply:
    """curl sends `Expect: 100-continue` before a body over 1 MiB: the 413 comes instead."""
    framing = ["-H", "Transfer-Encoding: chunked"] if chunked else []
    command = ["curl", "-sS", "-H", "Content-Type: application/json", *framing]
    command += ["--data-binary", "@-", "-w", "\n%{http_code}", url]
    done = subprocess.run(command, input=body, capture_output=True, timeout=60, check=True)
    text, _, status = done.stdout.rpartition(b"\n")
    return int(status), text


CLIENTS: dict[str, Callable[[str, bytes, bool], Reply]] = {
    "urllib": with_urllib,
    "httpx": with_httpx,
    "aiohttp": with_aiohttp,
    "curl": with_curl,
}


def assert_413(status: int, text: bytes) -> None:
    assert status == 413, (status, text[:300])
    error = assert_openai_error(json.loads(text), 413)
    assert error["type"] == "invalid_request_error" and error["param"] is None, error
    assert f"the body is over {MAX_BODY_BYTES} bytes" in error["message"], error


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_every_client_reads_the_413_of_a_body_over_the_limit(
    shared_stack: Stack, client: str, chunked: bool
) -> None:
    if client == "curl" and shutil.which("curl") is None:
        pytest.fail("curl is not installed (.ci/run installs it)")
    assert_413(*CLIENTS[client](shared_stack.http + DETOKENIZE, BODY, chunked))
    assert_http_serving_and_idle(shared_stack)


def test_the_openai_sdk_gets_413_as_its_status_error(shared_stack: Stack) -> None:
    client = openai.OpenAI(base_url=shared_stack.http + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model="tiny", prompt="word " * (2 * MIB), max_tokens=1)
    assert refused.value.status_code == 413
    assert "--max-receive-message-bytes" in str(refused.value)


def test_a_body_of_exactly_the_limit_is_served_and_one_byte_more_is_413(
    shared_stack: Stack,
) -> None:
    text = json.dumps({"tokens": [5, 6]}).encode()
    at_limit = text[:-1] + b" " * (MAX_BODY_BYTES - len(text)) + b"}"  # JSON allows the spaces
    assert len(at_limit) == MAX_BODY_BYTES
    url = shared_stack.http + DETOKENIZE
    for chunked in (False, True):
        status, reply = with_urllib(url, at_limit, chunked)
        assert status == 200 and json.loads(reply)["prompt"], reply[:300]
        assert_413(*with_urllib(url, at_limit + b" ", chunked))
    assert_http_serving_and_idle(shared_stack)


def connect(stack: Stack) -> socket.socket:
    address = urllib.parse.urlsplit(stack.http)
    return socket.create_connection((address.hostname, address.port), timeout=30)


def head(path: str, length: int, method: str = "POST", extra: str = "") -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n{extra}\r\n"
    ).encode()


def read_reply(reader: BinaryIO) -> tuple[int, bytes, bytes]:
    """One response (status, lower-cased head, body) from `sock.makefile("rb")`."""
    lines = []
    while (line := reader.readline()) not in (b"\r\n", b""):
        lines.append(line)
    assert lines, "closed before a response"
    top = b"".join(lines).lower()
    length = int(top.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
    return int(lines[0].split(b" ", 2)[1]), top, reader.read(length)


def test_a_huge_content_length_gets_413_before_any_of_its_body(shared_stack: Stack) -> None:
    """10^12 bytes declared, none sent: the 413 comes at once; nothing of it is read."""
    with connect(shared_stack) as sock:
        sock.sendall(head(TOKENIZE, 10**12))
        status, top, body = read_reply(sock.makefile("rb"))
        assert_413(status, body)
        assert b"connection: close" in top
    assert_http_serving_and_idle(shared_stack)


def test_the_413_comes_instead_of_100_continue(shared_stack: Stack) -> None:
    with connect(shared_stack) as sock:
        sock.sendall(head(DETOKENIZE, len(BODY), extra="Expect: 100-continue\r\n"))
        status, _, body = read_reply(sock.makefile("rb"))
        assert_413(status, body)  # not 100 Continue: the client need not send the body


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/nothing"), ("POST", "/ping")],
)
def test_routes_that_read_no_body_refuse_one_over_the_limit_too(
    shared_stack: Stack, method: str, path: str
) -> None:
    with connect(shared_stack) as sock:
        sock.sendall(head(path, MAX_BODY_BYTES + 1, method))
        status, _, body = read_reply(sock.makefile("rb"))
        assert_413(status, body)


SMALL = json.dumps({"tokens": [5]}).encode()


def test_a_kept_alive_connection_gets_413_for_its_second_request(shared_stack: Stack) -> None:
    with connect(shared_stack) as sock:
        reader = sock.makefile("rb")
        sock.sendall(head(DETOKENIZE, len(SMALL)) + SMALL)
        status, _, body = read_reply(reader)
        assert status == 200 and "prompt" in json.loads(body), body
        sock.sendall(head(DETOKENIZE, len(BODY)))
        status, top, body = read_reply(reader)
        assert_413(status, body)
        assert b"connection: close" in top


def test_a_pipelined_request_over_the_limit_gets_413_in_its_turn(shared_stack: Stack) -> None:
    """Two requests in one write, the second over the limit: 200, then 413 (the app's: the
    second waits for the first's response)."""
    with connect(shared_stack) as sock:
        sock.sendall(head(DETOKENIZE, len(SMALL)) + SMALL + head(DETOKENIZE, len(BODY)))
        reader = sock.makefile("rb")
        status, _, body = read_reply(reader)
        assert status == 200 and "prompt" in json.loads(body), body
        status, _, body = read_reply(reader)
        assert_413(status, body)


def test_a_body_past_the_drain_bound_is_cut_off(shared_stack: Stack) -> None:
    """The server reads at most MAX_DRAIN_BYTES of a refused body, then closes: a client that
    keeps sending cannot hold it reading (it gets a reset or a broken pipe)."""
    declared = MAX_BODY_BYTES + 8 * MAX_DRAIN_BYTES
    sent = 0
    with connect(shared_stack) as sock:
        sock.sendall(head(DETOKENIZE, declared))
        status, _, body = read_reply(sock.makefile("rb"))
        assert_413(status, body)
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            while sent < declared:
                sent += sock.send(b" " * MIB)
    assert sent < declared
    assert_http_serving_and_idle(shared_stack)

"""The HTTP port's timeouts and connection cap (issue 22 row 6), on a real frontend over raw
sockets: a connection that sends nothing is closed after --timeout-keep-alive, headers that
trickle get 408 after --http-header-timeout, a body that trickles gets 408 after
--http-body-timeout (as does a body refused with 413 that stops arriving), a connection past
--max-http-connections gets 503 at once while the others keep serving, and gRPC streams are
untouched throughout. On main, uvicorn closed none of these."""

from __future__ import annotations

import json
import socket
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.client import generate, text_request
from tests.e2e.stack import Stack
from tests.reliability.probes import wait_idle

pytestmark = pytest.mark.slow
IDLE_S, HEADER_S, BODY_S, MAX_CONNECTIONS = 2.0, 2.0, 2.0, 8
FLAGS = [
    *("--timeout-keep-alive", str(IDLE_S)),
    *("--http-header-timeout", str(HEADER_S)),
    *("--http-body-timeout", str(BODY_S)),
    *("--max-http-connections", str(MAX_CONNECTIONS)),
]
SLACK_S = 3.0
"""How late a timeout may fire on a loaded 2-core machine."""


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path) -> Iterator[Stack]:
    stack = Stack(tiny_model_dir, frontend_flags=FLAGS).start()
    yield stack
    stack.stop()


def connect(stack: Stack) -> socket.socket:
    address = urllib.parse.urlsplit(stack.http)
    sock = socket.create_connection((address.hostname, address.port), timeout=10)
    return sock


def read_until_closed(sock: socket.socket, within: float) -> tuple[bytes, float]:
    """What the server sends until it closes the connection, and how long that took."""
    started = time.monotonic()
    sock.settimeout(within)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"still open after {within:.0f} s; got {received[:200]!r}") from None
    return received, time.monotonic() - started


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0


def health(sock: socket.socket) -> int:
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    sock.settimeout(10)
    return status_of(sock.recv(65536))


def assert_grpc_serves(stack: Stack) -> None:
    done = generate(stack.frontend, text_request("still serving", max_tokens=2), timeout=60)
    assert done[0].finish_reason


def test_a_silent_connection_is_closed_after_the_idle_timeout(stack: Stack) -> None:
    connected = time.monotonic()
    with connect(stack) as silent, connect(stack) as served:
        assert health(served) == 200  # idle again after its response
        reply, _ = read_until_closed(silent, IDLE_S + SLACK_S)
        assert reply == b"" and time.monotonic() - connected >= IDLE_S
        assert read_until_closed(served, IDLE_S + SLACK_S)[0] == b""


def test_pipelined_requests_are_answered_in_order(stack: Stack) -> None:
    with connect(stack) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * 2 + b"GET /version HTTP/1.1\r\n")
        reply, _ = read_until_closed(sock, HEADER_S + SLACK_S)  # the third never ends: 408
    assert [status_of(b"HTTP/1.1 " + r) for r in reply.split(b"HTTP/1.1 ")[1:]] == [200, 200, 408]


def test_headers_that_trickle_get_408(stack: Stack) -> None:
    with connect(stack) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        sock.settimeout(0.2)
        reply = b""
        while not reply and time.monotonic() - started < HEADER_S + SLACK_S:
            try:
                sock.sendall(b"X")  # one byte of a header line at a time
                reply = sock.recv(65536)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
        assert status_of(reply) == 408, reply
        assert b"--http-header-timeout" in reply
    assert_grpc_serves(stack)


def test_a_body_that_trickles_gets_408(stack: Stack) -> None:
    with connect(stack) as sock:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(head + b"Content-Length: 100\r\n\r\n{")
        started = time.monotonic()
        reply, _ = read_until_closed(sock, BODY_S + SLACK_S)
        assert status_of(reply) == 408, reply
        assert b"--http-body-timeout" in reply
        assert time.monotonic() - started >= BODY_S - 0.5


def test_a_refused_body_that_stops_arriving_is_closed_after_the_body_timeout(
    stack: Stack,
) -> None:
    """413 at once (Content-Length over --max-receive-message-bytes); the server then reads
    what comes of the body, but waits for the rest no longer than --http-body-timeout."""
    with connect(stack) as sock:
        head = b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(head + f"Content-Length: {64 << 20}\r\n\r\n".encode() + b" " * (1 << 20))
        reply, _ = read_until_closed(sock, BODY_S + SLACK_S)
        assert status_of(reply) == 413, reply
        assert b"--max-receive-message-bytes" in reply


def test_headers_over_the_size_limit_get_431(stack: Stack) -> None:
    with connect(stack) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        for i in range(300):
            sock.sendall(f"X-Field-{i}: {'v' * 250}\r\n".encode())
        reply, _ = read_until_closed(sock, SLACK_S)
        assert status_of(reply) == 431, reply


def open_stream(stack: Stack) -> socket.socket:
    """A connection streaming a long completion (busy, so no timeout applies to it)."""
    body = json.dumps({"prompt": "go", "max_tokens": 1000, "ignore_eos": True, "stream": True})
    sock = connect(stack)
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n{body}".encode())
    assert status_of(sock.recv(65536)) == 200
    return sock


def test_connections_past_the_cap_get_503_while_the_others_serve(stack: Stack) -> None:
    streams = [open_stream(stack) for _ in range(MAX_CONNECTIONS)]
    try:
        with connect(stack) as extra:
            reply, _ = read_until_closed(extra, SLACK_S)
        assert status_of(reply) == 503 and b"retry-after: 1" in reply.lower(), reply
        assert b"--max-http-connections" in reply
        for sock in streams:  # each still streams
            assert b"data: " in sock.recv(65536)
        assert_grpc_serves(stack)
    finally:
        for sock in streams:
            sock.close()
    wait_idle(stack, within=30)  # the closed streams were aborted
    with connect(stack) as again:
        assert health(again) == 200

"""OpenAI `/v1/completions` streaming over plain asyncio streams (the project's venv has no HTTP
client library, and the benchmark needs none: one POST per request, then server-sent events).

Pure parts (tested without a network): `SseParser` splits a byte stream into event payloads,
`completion_chunk_tokens` counts the tokens one completion chunk carries, `dechunk` undoes
HTTP/1.1 chunked transfer coding.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

DONE = "[DONE]"


class HttpError(RuntimeError):
    """The server answered with a status other than 200."""


class SseParser:
    """Incremental server-sent-events parser: feed bytes as they arrive, get each complete
    event's `data` (its `data:` lines joined with newlines). Comments and other fields are
    skipped; CRLF and LF line ends are both accepted, even when split between two feeds."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[str]:
        self._buffer += data
        normalized = self._buffer.replace(b"\r\n", b"\n")
        if normalized.endswith(b"\r"):  # a CRLF split across feeds: wait for its LF
            normalized = normalized[:-1]
            keep_cr = b"\r"
        else:
            keep_cr = b""
        *blocks, rest = normalized.split(b"\n\n")
        self._buffer = rest + keep_cr
        events = [self._data_of(block.decode("utf-8")) for block in blocks]
        return [e for e in events if e is not None]

    @staticmethod
    def _data_of(block: str) -> str | None:
        lines = [line for line in block.split("\n") if line.startswith("data:")]
        if not lines:
            return None
        return "\n".join(line[5:].removeprefix(" ") for line in lines)


def completion_chunk_tokens(chunk: Mapping[str, Any]) -> int:
    """New tokens in one streamed completion chunk: the length of each choice's `token_ids`
    (vLLM's `return_token_ids`), or one per choice when the server sends no ids. A chunk
    without choices (the usage chunk) carries none."""
    total = 0
    for choice in chunk.get("choices") or []:
        token_ids = choice.get("token_ids")
        total += len(token_ids) if token_ids is not None else 1
    return total


class ByteReader(Protocol):
    async def readline(self) -> bytes: ...

    async def readexactly(self, n: int) -> bytes: ...

    async def read(self, n: int = -1) -> bytes: ...


async def dechunk(reader: ByteReader) -> AsyncIterator[bytes]:
    """The pieces of an HTTP/1.1 chunked body, as they arrive."""
    while True:
        size_line = await reader.readline()
        if not size_line:
            raise ConnectionError("connection closed inside a chunked body")
        size = int(size_line.split(b";")[0].strip(), 16)
        if size == 0:
            await reader.readline()  # the blank line after the last chunk (no trailers sent)
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)  # CRLF after each chunk


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("connection closed before the response")
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


async def _body(reader: asyncio.StreamReader, headers: Mapping[str, str]) -> AsyncIterator[bytes]:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        async for piece in dechunk(reader):
            yield piece
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while piece := await reader.read(65536):
            yield piece


async def post_sse(host: str, port: int, path: str, body: Mapping[str, Any]) -> AsyncIterator[str]:
    """POST `body` as JSON and yield the response's server-sent events' data as they arrive.
    One connection per request (`Connection: close`), as a load generator of independent
    users would open."""
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\n"
            "Connection: close\r\n\r\n"
        )
        writer.write(head.encode("latin-1") + payload)
        await writer.drain()
        status, headers = await _read_head(reader)
        if status != 200:
            text = b"".join([piece async for piece in _body(reader, headers)])
            raise HttpError(f"HTTP {status} from {path}: {text.decode(errors='replace')[:500]}")
        parser = SseParser()
        async for piece in _body(reader, headers):
            for event in parser.feed(piece):
                yield event
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def post_sse_json(
    host: str, port: int, path: str, body: Mapping[str, Any]
) -> AsyncIterator[dict[str, Any]]:
    """post_sse's events as JSON objects, up to the closing [DONE]; an error event raises
    RuntimeError ("error event: ...")."""
    async for data in post_sse(host, port, path, body):
        if data == DONE:
            return
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(f"error event: {chunk['error']}")
        yield chunk


def post_json(url: str, body: Mapping[str, Any], timeout: float = 60.0) -> bytes:
    """POST `body` as JSON to `url`; the reply's body (an error status raises HTTPError)."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return bytes(reply.read())


def http_get_ok(url: str, timeout: float = 2.0) -> bool:
    """True when GET `url` answers 200 (a readiness probe)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False

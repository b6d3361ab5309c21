"""The HTTP port's connection limits, which uvicorn lacks: uvicorn closes a connection only once it
has answered one request and then sat idle (`timeout_keep_alive`), so a client that connects and
sends nothing, sends its headers a byte at a time, or its body a byte a second holds a descriptor
(and its buffers) forever, and httptools reads headers of any size.

    connected or answered --idle timeout--> closed     (--timeout-keep-alive, uvicorn's name)
    first byte of a request --header timeout--> 408    (--http-header-timeout)
    headers complete --body timeout--> 408             (--http-body-timeout, the whole body)
    headers over 64 KiB or 256 fields --> 431
    a body over --max-receive-message-bytes --> 413    (by its Content-Length at once, or as
                                                        a chunked body arrives; any route)
    a connection past --max-http-connections --> 503 with Retry-After, at once

A refused connection gets its response, then the server stops writing and reads (and drops)
what the client still sends before it closes: closing with unread data would reset the
connection, and the reset can discard the response before the client reads it (Python's urllib,
or any client that writes its whole body before it reads, would see only a broken pipe). After
408, 431 and 503 it reads for at most LINGER_S; after 413 until the body's end, MAX_DRAIN_BYTES
more of it or the body's deadline (--http-body-timeout), whichever comes first (nginx's lingering
close). Nothing here bounds the time a response takes (a long generation streams for as long as
it needs).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import json
import logging
import resource
from dataclasses import dataclass
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from frontend_svc.errors import BodyTooLarge
from splitserve_runtime.listener import DEFAULT_PUBLIC_MAX_RECEIVE_BYTES

logger = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 * 1024
"""Request line and header fields together (nginx's default buffers hold 32 KiB)."""
MAX_HEADER_COUNT = 256
"""Header fields per request (vLLM's --h11-max-header-count default)."""
LINGER_S = 1.0
"""How long a refused connection is read (and dropped) before it closes."""
MAX_DRAIN_BYTES = 16 * 1024 * 1024
"""How much more of a body refused with 413 is read (and dropped) before the connection closes:
a body a few MiB over the limit still ends cleanly, so that a client that reads only once it has
sent everything gets the 413; a larger one is cut off (reset) there."""


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """The HTTP port's limits (the frontend's flags)."""

    timeout_keep_alive: float = 5.0
    """Seconds a connection may sit without a request in progress (new or after a response)."""
    header_timeout: float = 10.0
    """Seconds from a request's first byte to the end of its headers."""
    body_timeout: float = 60.0
    """Seconds from the end of the headers to the end of the body."""
    max_connections: int = 4096
    """Open connections; more are refused with 503 at once."""
    max_body_bytes: int = DEFAULT_PUBLIC_MAX_RECEIVE_BYTES
    """A request's body (--max-receive-message-bytes, as the gRPC port's largest message); a
    larger one is refused with 413."""


def raise_open_file_limit(wanted: int = 65536) -> int:
    """Raise this process's soft limit of open descriptors towards `wanted` (not past the hard
    limit), as vLLM's API server does; returns the soft limit now in force. The gRPC and HTTP
    ports, the core stream and the model's files all take descriptors from it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as err:
            logger.warning("cannot raise the open file limit from %d to %d: %s", soft, target, err)
    return int(soft) if soft != resource.RLIM_INFINITY else wanted


def fitted_limits(limits: HttpLimits, open_file_limit: int) -> HttpLimits:
    """`limits` with the connection cap at most half the descriptors, so that HTTP clients can
    never take those the gRPC port and the engine need."""
    cap = max(1, open_file_limit // 2)
    if limits.max_connections <= cap:
        return limits
    logger.warning(
        "--max-http-connections %d lowered to %d: half of this process's open file limit "
        "(ulimit -n %d); raise that limit to allow more",
        limits.max_connections,
        cap,
        open_file_limit,
    )
    return dataclasses.replace(limits, max_connections=cap)


class _Phase(enum.Enum):
    IDLE = "idle"
    HEADERS = "headers"
    BODY = "body"
    ANSWERING = "answering"


class _HeadersTooLarge(Exception):
    pass


def _raw_response(status: int, message: str, extra: tuple[tuple[str, str], ...] = ()) -> bytes:
    """A complete HTTP/1.1 response with OpenAI's error JSON, for refusals made before (or
    instead of) the app."""
    error_type = "invalid_request_error" if status < 500 else "service_unavailable"
    error = {"message": message, "type": error_type, "param": None, "code": status}
    body = json.dumps({"error": error}, separators=(",", ":")).encode()  # as the app's
    headers = [
        ("content-type", "application/json"),
        ("content-length", str(len(body))),
        ("connection", "close"),
        *extra,
    ]
    head = "".join(f"{name}: {value}\r\n" for name, value in headers)
    return STATUS_LINE[status] + head.encode("latin-1") + b"\r\n" + body


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol under `limits` (see the module's docstring). Build it with
    `protocol_class`, which binds the limits."""

    limits = HttpLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeout_keep_alive = self.limits.timeout_keep_alive  # type: ignore[assignment]
        self._phase = _Phase.IDLE
        self._deadline: asyncio.TimerHandle | None = None
        self._is_refused = False
        self._num_header_bytes = 0
        self._num_headers = 0
        self._num_body_bytes = 0
        self._num_drained: int | None = None
        """Bytes of a refused body read and dropped so far; None: not draining one."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.connections.discard(self)
            self._refuse(
                503,
                f"this server has {self.limits.max_connections} connections open, its limit "
                "(--max-http-connections); retry shortly",
                (("retry-after", "1"),),
            )
            return
        self._become_idle()  # a new connection is idle until its first byte

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._num_drained is not None:  # the rest of a body refused with 413
            with contextlib.suppress(httptools.HttpParserError, httptools.HttpParserUpgrade):
                self.parser.feed_data(data)  # on_body drops it, on_message_complete closes
            return
        if self._is_refused:
            return  # lingering: read and drop
        if self._phase is _Phase.IDLE:
            self._start_headers()
        super().data_received(data)  # a parser error ends in uvicorn's 400 (ours: 431)

    def send_400_response(self, msg: str) -> None:
        if not self._is_refused:  # a refusal already answered (and ended) this connection
            super().send_400_response(msg)

    def on_message_begin(self) -> None:
        if self._is_refused:
            return
        if self._phase is not _Phase.HEADERS:
            self._start_headers()
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count_header_bytes(len(url), 0)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header_bytes(len(name) + len(value), 1)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._is_refused:
            return
        self._phase = _Phase.BODY
        self._num_body_bytes = 0
        self._arm(self.limits.body_timeout, self._body_timed_out)
        previous = self.cycle  # None, answered, or (pipelining) a response still in progress
        is_next = previous is None or previous.response_complete
        if self._declared_length() > self.limits.max_body_bytes and is_next:
            self._refuse_body(answer=True)  # at once: no app runs for it
            return
        super().on_headers_complete()  # pipelined: queued (refused in its turn, by the app)

    def on_body(self, body: bytes) -> None:
        if self._num_drained is not None:
            self._num_drained += len(body)
            if self._num_drained > MAX_DRAIN_BYTES:
                self.transport.close()  # past the bound: cut off
            return
        if self._is_refused:
            return
        self._num_body_bytes += len(body)
        if self._num_body_bytes > self.limits.max_body_bytes and not self.pipeline:
            self._refuse_body(answer=not self.cycle.response_started)  # this request's cycle
            return
        super().on_body(body)  # queued behind a response: uvicorn holds it, reading paused

    def on_message_complete(self) -> None:
        if self._num_drained is not None:  # the refused body ended: a clean close
            self._num_drained = None
            self.transport.close()
            return
        if self._is_refused:
            return
        self._cancel_deadline()
        if self.cycle is not None and self.cycle.response_complete:  # answered before its end
            self._become_idle()
        else:
            self._phase = _Phase.ANSWERING
        super().on_message_complete()

    def on_response_complete(self) -> None:
        if self._phase is _Phase.ANSWERING:
            self._phase = _Phase.IDLE
        super().on_response_complete()  # arms the idle timeout

    def _become_idle(self) -> None:
        self._phase = _Phase.IDLE
        if self.timeout_keep_alive_task is None and not self.transport.is_closing():
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    def _start_headers(self) -> None:
        self._phase = _Phase.HEADERS
        self._num_header_bytes = self._num_headers = 0
        self._arm(self.limits.header_timeout, self._headers_timed_out)

    def _count_header_bytes(self, num_bytes: int, num_headers: int) -> None:
        self._num_header_bytes += num_bytes
        self._num_headers += num_headers
        if self._num_header_bytes > MAX_HEADER_BYTES or self._num_headers > MAX_HEADER_COUNT:
            self._refuse(
                431,
                f"the request's headers are over {MAX_HEADER_BYTES} bytes or "
                f"{MAX_HEADER_COUNT} fields",
            )
            raise _HeadersTooLarge  # stops the parser; uvicorn's 400 for it is suppressed

    def _headers_timed_out(self) -> None:
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined request behind a response still streaming: its turn has not come.
            self._arm(self.limits.header_timeout, self._headers_timed_out)
            return
        self._refuse(
            408,
            f"the request's headers did not arrive within {self.limits.header_timeout:g} s "
            "(--http-header-timeout)",
        )

    def _body_timed_out(self) -> None:
        if self._num_drained is not None:  # a refused body still arriving: enough waiting
            self.transport.close()
            return
        if self.pipeline:  # queued behind a response still streaming (reading is paused)
            self._arm(self.limits.body_timeout, self._body_timed_out)
            return
        cycle = self.cycle
        if cycle is not None and cycle.response_started:
            self._refuse_silently()  # answered already (e.g. 401) and the body still trickles
            return
        self._refuse(
            408,
            f"the request's body did not arrive within {self.limits.body_timeout:g} s "
            "(--http-body-timeout)",
        )

    def _refuse(self, status: int, message: str, extra: tuple[tuple[str, str], ...] = ()) -> None:
        """Answer `status` and end the connection (the app, if it runs, sees a disconnect)."""
        if self._is_refused or self.transport.is_closing():
            return
        self.transport.write(_raw_response(status, message, extra))
        self._refuse_silently()

    def _declared_length(self) -> int:
        """The request's Content-Length (httptools has checked it is a number); 0 if none."""
        for name, value in self.headers:
            if name == b"content-length":
                return int(value)
        return 0

    def _refuse_body(self, answer: bool) -> None:
        """A body over the limit: 413 unless the app has answered already (e.g. a 401 sent
        before the body), the app (if it runs) sees a disconnect, and the rest of the body is
        read and dropped until its end (then the connection closes), MAX_DRAIN_BYTES more or
        the body's deadline."""
        limit = self.limits.max_body_bytes
        if answer:
            self.transport.write(_raw_response(413, str(BodyTooLarge(limit))))
            if self.transport.can_write_eof():
                self.transport.write_eof()
        self._is_refused = True
        self._num_drained = max(0, self._num_body_bytes - limit)
        self._unset_keepalive_if_required()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        self.flow.resume_reading()  # uvicorn pauses it while the app has not read the body

    def _refuse_silently(self) -> None:
        self._is_refused = True
        self._cancel_deadline()
        self._unset_keepalive_if_required()
        if self.cycle is not None:
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        transport = self.transport
        if transport.can_write_eof():
            transport.write_eof()
            transport.resume_reading()
            self.loop.call_later(LINGER_S, transport.close)
        else:
            transport.close()

    def _arm(self, seconds: float, callback: Any) -> None:
        self._cancel_deadline()
        self._deadline = self.loop.call_later(seconds, callback)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None


def protocol_class(limits: HttpLimits) -> type[LimitedHttpToolsProtocol]:
    """LimitedHttpToolsProtocol bound to `limits` (uvicorn builds one per connection)."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})

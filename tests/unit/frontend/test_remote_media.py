"""Remote image URLs: off unless hosts are allowed; then only those hosts, only public addresses
(checked on every address and every redirect), a byte limit enforced while reading and one
deadline for the whole fetch. A real HTTP server on loopback serves the images; the tests that
fetch from it allow loopback explicitly (the default policy refuses it, as checked first)."""

from __future__ import annotations

import contextlib
import http.server
import threading
import time
from collections.abc import Iterator

import pytest

from frontend_svc.errors import InvalidRequest
from frontend_svc.inputs.remote_media import RemoteMediaFetcher, is_public_address

BODY = b"\x89PNG fake image bytes" * 10


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        # The fetcher under test hangs up at its limits, as it should.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self._serve()

    def _serve(self) -> None:
        if self.path == "/image.png":
            self._send(BODY, {"Content-Type": "image/png"})
        elif self.path == "/redirect":
            self._send(b"", {"Location": "http://elsewhere.test/image.png"}, status=302)
        elif self.path == "/local-redirect":
            self._send(b"", {"Location": "/image.png"}, status=302)
        elif self.path == "/endless":  # no Content-Length: only the running count can stop it
            self.send_response(200)
            self.end_headers()
            for _ in range(100):
                self.wfile.write(b"x" * 1024)
        elif self.path == "/slow":
            self.send_response(200)
            self.end_headers()
            for _ in range(30):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)
        else:
            self._send(b"no", {}, status=404)

    def _send(self, body: bytes, headers: dict[str, str], status: int = 200) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[int]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield int(httpd.server_address[1])
    httpd.shutdown()
    httpd.server_close()


def loopback_fetcher(max_bytes: int = 10_000, timeout: float = 5.0) -> RemoteMediaFetcher:
    """Allows the host `images.test`, resolved to 127.0.0.1, loopback included."""
    return RemoteMediaFetcher(
        ("images.test",),
        timeout,
        max_bytes,
        resolve=lambda host, port: ["127.0.0.1"] if host == "images.test" else [],
        is_allowed_address=lambda address: True,
    )


def refusal(fetcher: RemoteMediaFetcher, url: str) -> str:
    with pytest.raises(InvalidRequest) as err:
        fetcher.fetch(url, "part")
    assert err.value.param == "part"
    return str(err.value)


def test_remote_urls_are_off_unless_domains_are_allowed() -> None:
    fetcher = RemoteMediaFetcher((), 5.0, 1000)
    assert "disabled" in refusal(fetcher, "https://example.com/a.png")


def test_private_addresses_are_refused_by_default(server: int) -> None:
    fetcher = RemoteMediaFetcher(("localhost",), 5.0, 10_000)
    assert "private or reserved" in refusal(fetcher, f"http://localhost:{server}/image.png")
    for address in ("127.0.0.1", "10.1.2.3", "169.254.169.254", "::1", "::ffff:192.168.0.1"):
        assert not is_public_address(address)
    assert is_public_address("8.8.8.8")


def test_an_allowed_host_is_fetched(server: int) -> None:
    body, content_type = loopback_fetcher().fetch(f"http://images.test:{server}/image.png", "p")
    assert body == BODY and content_type == "image/png"
    body, _ = loopback_fetcher().fetch(f"http://images.test:{server}/local-redirect", "p")
    assert body == BODY


def test_other_hosts_and_redirects_to_them_are_refused(server: int) -> None:
    assert "not among the allowed" in refusal(loopback_fetcher(), f"http://other.test:{server}/")
    assert "not among the allowed" in refusal(
        loopback_fetcher(), f"http://images.test:{server}/redirect"
    )


def test_size_and_time_limits_hold_while_reading(server: int) -> None:
    assert "more than the 2000" in refusal(
        loopback_fetcher(max_bytes=2000), f"http://images.test:{server}/endless"
    )
    assert "more than the 100" in refusal(
        loopback_fetcher(max_bytes=100), f"http://images.test:{server}/image.png"
    )
    started = time.monotonic()
    assert "longer than" in refusal(
        loopback_fetcher(timeout=0.5), f"http://images.test:{server}/slow"
    )
    assert time.monotonic() - started < 2.5
    assert "HTTP 404" in refusal(loopback_fetcher(), f"http://images.test:{server}/missing")

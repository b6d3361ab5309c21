"""The OpenAI HTTP port serves HTTPS with --ssl-certfile/--ssl-keyfile (the gRPC port's files), and
requires client certificates with --ssl-ca-certs, as vLLM's server does."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from frontend_svc.openai.server import HttpServer
from splitserve.local_pki import CertificateAuthority
from splitserve_runtime.listener import DEFAULT_PUBLIC_MAX_RECEIVE_BYTES
from splitserve_runtime.tls import TlsFiles


async def health(request: Request) -> Response:
    return Response(status_code=200)


@contextlib.contextmanager
def serving(tls: TlsFiles) -> Iterator[str]:
    app = Starlette(routes=[Route("/health", health)])
    loop = asyncio.new_event_loop()
    http = HttpServer(app, "127.0.0.1", 0, tls=tls)
    threading.Thread(target=loop.run_forever, daemon=True).start()
    port = asyncio.run_coroutine_threadsafe(http.start(), loop).result(30)
    try:
        yield f"localhost:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(http.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> tuple[CertificateAuthority, Path]:
    return CertificateAuthority(), tmp_path_factory.mktemp("pki")


def client_context(folder: Path, cert: TlsFiles | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(folder / "ca.crt"))
    if cert is not None:
        context.load_cert_chain(cert.cert_file, cert.key_file)
    return context


def test_https_with_the_servers_certificate(ca: tuple[CertificateAuthority, Path]) -> None:
    authority, folder = ca
    server = authority.write(folder, "server", ["localhost"])
    with serving(TlsFiles(server.cert_file, server.key_file)) as address:
        context = client_context(folder)
        with urllib.request.urlopen(f"https://{address}/health", context=context) as reply:
            assert reply.status == 200
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"http://{address}/health", timeout=10).read()


def test_client_certificates_required_with_a_ca(ca: tuple[CertificateAuthority, Path]) -> None:
    authority, folder = ca
    server = authority.write(folder, "mtls-server", ["localhost"])
    client = authority.write(folder, "client", ["some-client"])
    with serving(server) as address:  # TlsFiles with ca_file: client certificates required
        context = client_context(folder, client)
        with urllib.request.urlopen(f"https://{address}/health", context=context) as reply:
            assert reply.status == 200
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            urllib.request.urlopen(f"https://{address}/health", context=client_context(folder))


def test_a_body_over_the_limit_gets_413_over_https(ca: tuple[CertificateAuthority, Path]) -> None:
    """TLS has no half-close: the server reads and drops the rest of the body all the same, so
    urllib (which sends everything before it reads) gets the 413."""
    authority, folder = ca
    server = authority.write(folder, "limit-server", ["localhost"])
    with serving(TlsFiles(server.cert_file, server.key_file)) as address:
        body = b"x" * (DEFAULT_PUBLIC_MAX_RECEIVE_BYTES + 3 * 1024 * 1024)
        request = urllib.request.Request(f"https://{address}/health", data=body)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, context=client_context(folder), timeout=30)
        assert refused.value.code == 413
        assert b"--max-receive-message-bytes" in refused.value.read()

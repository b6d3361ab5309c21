"""Fetching http(s) image URLs, off unless `--allowed-media-domains` names hosts.

A server that fetches URLs for its clients can be pointed at its own network (SSRF), so: only
the allowed hosts, only public addresses (every address the name resolves to is checked, and
the connection goes to the checked address, so a second DNS answer cannot swap in a private
one), a size limit enforced while reading (never after materializing: vLLM's CVE-2026-100650),
one deadline for the whole fetch, and at most a few redirects, each checked the same way.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import time
from collections.abc import Callable
from urllib.parse import urljoin, urlsplit

from frontend_svc.errors import InvalidRequest

MAX_REDIRECTS = 3
_CHUNK = 64 * 1024

Resolver = Callable[[str, int], list[str]]
AddressPolicy = Callable[[str], bool]


def resolve_addresses(host: str, port: int) -> list[str]:
    """Every address `host` resolves to."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def is_public_address(address: str) -> bool:
    """Whether `address` is globally routable (not loopback, private, link-local, multicast,
    reserved or unspecified; IPv4-mapped IPv6 addresses are judged as IPv4)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """Connects to a pre-checked address while speaking to `host`."""

    def __init__(self, host: str, address: str, port: int, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self.address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self.address, self.port), self.timeout)


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    """TLS to a pre-checked address, verifying the certificate of `host`."""

    def __init__(self, host: str, address: str, port: int, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self.address = address

    def connect(self) -> None:
        sock = socket.create_connection((self.address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)  # type: ignore[attr-defined]


class RemoteMediaFetcher:
    """Fetches image URLs under the policy above; every refusal is InvalidRequest."""

    def __init__(
        self,
        allowed_domains: tuple[str, ...],
        timeout: float,
        max_bytes: int,
        resolve: Resolver = resolve_addresses,
        is_allowed_address: AddressPolicy = is_public_address,
    ) -> None:
        self.allowed_domains = frozenset(d.strip().lower().rstrip(".") for d in allowed_domains)
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.resolve = resolve
        self.is_allowed_address = is_allowed_address

    def fetch(self, url: str, where: str) -> tuple[bytes, str]:
        """The body and Content-Type of an allowed image URL."""
        if not self.allowed_domains:
            raise InvalidRequest(
                f"{where}: remote image URLs are disabled on this server; send the image inline "
                "(a data: URL or bytes), or start the frontend with --allowed-media-domains",
                where,
            )
        deadline = time.monotonic() + self.timeout
        for _ in range(MAX_REDIRECTS + 1):
            response, connection = self._request(url, where, deadline)
            try:
                location = response.getheader("Location")
                if response.status in (301, 302, 303, 307, 308) and location:
                    url = urljoin(url, location)
                    continue
                if response.status != 200:
                    raise InvalidRequest(
                        f"{where}: fetching the image URL failed with HTTP {response.status}",
                        where,
                    )
                body = self._read_limited(response, connection, where, deadline)
                return body, response.getheader("Content-Type") or ""
            finally:
                connection.close()
        raise InvalidRequest(
            f"{where}: the image URL redirects more than {MAX_REDIRECTS} times", where
        )

    def _request(
        self, url: str, where: str, deadline: float
    ) -> tuple[http.client.HTTPResponse, http.client.HTTPConnection]:
        parts = urlsplit(url)
        host = (parts.hostname or "").lower().rstrip(".")
        if parts.scheme not in ("http", "https") or not host:
            raise InvalidRequest(f"{where}: not an http(s) image URL", where)
        if host not in self.allowed_domains:
            raise InvalidRequest(
                f"{where}: the host {host[:253]!r} is not among the allowed media domains "
                "(--allowed-media-domains)",
                where,
            )
        port = parts.port or (443 if parts.scheme == "https" else 80)
        address = self._checked_address(host, port, where)
        timeout = max(0.001, deadline - time.monotonic())
        cls = _PinnedHTTPSConnection if parts.scheme == "https" else _PinnedHTTPConnection
        connection = cls(host, address, port, timeout)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        try:
            connection.request("GET", path, headers={"Accept": "image/*"})
            return connection.getresponse(), connection
        except (OSError, http.client.HTTPException):
            connection.close()
            raise InvalidRequest(f"{where}: the image URL could not be fetched", where) from None

    def _checked_address(self, host: str, port: int, where: str) -> str:
        try:
            addresses = self.resolve(host, port)
        except OSError:
            raise InvalidRequest(f"{where}: the image URL's host does not resolve", where) from None
        if not addresses or not all(self.is_allowed_address(a) for a in addresses):
            raise InvalidRequest(
                f"{where}: the image URL's host resolves to a private or reserved address; "
                "only public addresses are fetched",
                where,
            )
        return addresses[0]

    def _read_limited(
        self,
        response: http.client.HTTPResponse,
        connection: http.client.HTTPConnection,
        where: str,
        deadline: float,
    ) -> bytes:
        """The body, read one socket read at a time, each bounded by the time left."""
        length = response.getheader("Content-Length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            raise self._too_large(int(length), where)
        chunks: list[bytes] = []
        num_bytes = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise InvalidRequest(
                    f"{where}: fetching the image URL took longer than {self.timeout:g} s", where
                )
            try:
                if connection.sock is not None:
                    connection.sock.settimeout(remaining)
                chunk = response.read1(_CHUNK)
            except (OSError, http.client.HTTPException):
                raise InvalidRequest(
                    f"{where}: reading the image URL failed or took longer than {self.timeout:g} s",
                    where,
                ) from None
            if not chunk:
                return b"".join(chunks)
            num_bytes += len(chunk)
            if num_bytes > self.max_bytes:
                raise self._too_large(num_bytes, where)
            chunks.append(chunk)

    def _too_large(self, num_bytes: int, where: str) -> InvalidRequest:
        return InvalidRequest(
            f"{where}: the image URL serves {num_bytes}+ bytes, more than the {self.max_bytes} "
            "allowed (--max-image-bytes)",
            where,
        )

"""Clients for the security tests that present whatever certificate (or none) a test needs."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.local_pki import CertificateAuthority
from splitserve_runtime.channels import ChannelSecurity, open_channel
from splitserve_runtime.tls import TlsFiles

EPOCH_KEY = "x-splitserve-owner-epoch"


def issue(ca: CertificateAuthority, folder: Path, stem: str, names: list[str]) -> TlsFiles:
    """Certificate files for `names`, signed by `ca`."""
    folder.mkdir(parents=True, exist_ok=True)
    return ca.write(folder, stem, names)


def channel(addr: str, files: TlsFiles | None, server_role: str) -> grpc.Channel:
    """A channel presenting `files` (None: plaintext) to a server expected to be `server_role`."""
    return open_channel(addr, ChannelSecurity(files, server_role))


def health_status(addr: str, files: TlsFiles | None, server_role: str, service: str = "") -> int:
    with channel(addr, files, server_role) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
        return int(reply.status)


def rpc_error(call: Any) -> grpc.RpcError:
    """The RpcError a call (a thunk) raises; fails the test when it succeeds."""
    try:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, bytes | str):
            list(result)
    except grpc.RpcError as err:
        return err
    raise AssertionError("the call succeeded")


def raw_unary(ch: grpc.Channel, method: str, payload: bytes, **kwargs: Any) -> Any:
    """Send `payload` bytes as the request of a unary(-request) method."""
    return ch.unary_unary(method)(payload, timeout=10, **kwargs)


def raw_unary_stream(ch: grpc.Channel, method: str, payload: bytes, **kwargs: Any) -> list[Any]:
    return list(ch.unary_stream(method)(payload, timeout=10, **kwargs))


def raw_stream(ch: grpc.Channel, method: str, payloads: list[bytes], **kwargs: Any) -> list[Any]:
    return list(ch.stream_stream(method)(iter(payloads), timeout=10, **kwargs))


HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
"""A client's HTTP/2 connection preface and an empty SETTINGS frame."""


def tls_context(files: TlsFiles) -> ssl.SSLContext:
    """A client context presenting `files`' certificate and trusting its CA, speaking h2."""
    context = ssl.create_default_context(cafile=files.ca_file)
    context.load_cert_chain(files.cert_file, files.key_file)
    context.set_alpn_protocols(["h2"])
    return context


def speaks_http2(addr: str, context: ssl.SSLContext | None = None, server_name: str = "") -> bool:
    """Whether the server LISTENING at `addr` takes this client (plaintext, or TLS with
    `context`) as far as HTTP/2: it answers the connection preface with a SETTINGS frame. False
    when it refuses the transport (a TLS handshake it fails or aborts). A port nobody listens on
    raises ConnectionRefusedError instead: unlike gRPC's UNAVAILABLE, never taken for a refusal."""
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        try:
            sock = raw if context is None else context.wrap_socket(raw, server_hostname=server_name)
            sock.sendall(HTTP2_PREFACE)
            header = sock.recv(9)
        except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
            return False
    # A frame header: 24-bit length, type 0x4 (SETTINGS), flags, stream 0.
    return len(header) == 9 and header[3] == 0x04 and header[5:] == b"\x00\x00\x00\x00"

"""Clients for the security tests that present whatever certificate (or none) a test needs."""

from __future__ import annotations

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

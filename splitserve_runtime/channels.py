"""Client channels of the internal hops (frontend -> core, core -> workers): one place decides
plaintext or mutual TLS, the expected role of the server, message sizes and keepalive."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from splitserve_runtime.grpc_client_metrics import GrpcClientMetrics
from splitserve_runtime.listener import MAX_INTERNAL_MESSAGE_BYTES
from splitserve_runtime.services import INTERNAL_SECRET_METADATA_KEY
from splitserve_runtime.tls import TlsFiles, channel_credentials

Metadata = tuple[tuple[str, str], ...]

CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_send_message_length", MAX_INTERNAL_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_INTERNAL_MESSAGE_BYTES),
    # Notice a dead peer (a half-open connection) in ~30 s even on an idle stream. The servers
    # allow pings every 5 s (splitserve_runtime.listener), so these never count as abuse.
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Find a restarted peer (an engine core or a worker rank coming back at the same address)
    # within a second: gRPC's default reconnect backoff grows to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


@dataclass(frozen=True, slots=True)
class ChannelSecurity:
    """How to reach one kind of server: plaintext (`tls` None) or mutual TLS, where the server
    must present a certificate naming `server_role` (whatever its address); `secret` (the
    deployment's --internal-secret, "" for none) goes with every call that passes
    `call_metadata()`."""

    tls: TlsFiles | None
    server_role: str
    secret: str = field(default="", repr=False)

    def call_metadata(self, *extra: tuple[str, str]) -> Metadata:
        """The metadata of a call to the server: the internal secret (if any), then `extra`.
        Every call to an internal service passes it (an interceptor would put grpc.aio's
        streams behind an extra queue)."""
        if not self.secret:
            return tuple(extra)
        return ((INTERNAL_SECRET_METADATA_KEY, self.secret), *extra)

    def options(self) -> list[tuple[str, Any]]:
        options = list(CHANNEL_OPTIONS)
        if self.tls is not None:
            options.append(("grpc.ssl_target_name_override", self.server_role))
        return options


def open_channel(
    addr: str, security: ChannelSecurity, metrics: GrpcClientMetrics | None = None
) -> grpc.Channel:
    """A synchronous channel to `addr` (its calls counted in `metrics`, if given)."""
    if security.tls is None:
        channel = grpc.insecure_channel(addr, options=security.options())
    else:
        creds = channel_credentials(security.tls)
        channel = grpc.secure_channel(addr, creds, options=security.options())
    return channel if metrics is None else metrics.intercept(channel)


def open_aio_channel(
    addr: str,
    security: ChannelSecurity,
    extra_options: Sequence[tuple[str, Any]] = (),
    metrics: GrpcClientMetrics | None = None,
) -> grpc.aio.Channel:
    """A grpc.aio channel to `addr` (`extra_options` add channel arguments; its calls counted
    in `metrics`, if given)."""
    options = [*security.options(), *extra_options]
    if security.tls is None:
        channel = grpc.aio.insecure_channel(addr, options=options)
    else:
        creds = channel_credentials(security.tls)
        channel = grpc.aio.secure_channel(addr, creds, options=options)
    return channel if metrics is None else metrics.wrap_aio(channel)

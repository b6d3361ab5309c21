"""How a service's gRPC port is exposed: plaintext or TLS, who may call which service, the
server's connection limits, reflection, and an optional plaintext port serving only health.

Internal ports (core, workers): mutual TLS when certificates are given, each service admitting
only the roles that may call it; message size limits stay large (a step can be big); keepalive
and an idle limit, but no connection age limit: the EngineStream and Execute streams live as
long as the engine. The public port (frontend): optional TLS (client certificates only when a
CA is given), a 4 MiB request limit, keepalive, idle and age limits (age with a long grace, so
a running Generate is not cut), and unexpected errors shielded behind an error id.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc

from splitserve_runtime.rpc_guard import (
    Admission,
    GuardPolicy,
    all_of,
    role_admission,
    secret_admission,
)
from splitserve_runtime.tls import TlsFiles, server_credentials

logger = logging.getLogger(__name__)

MiB = 1024 * 1024
MAX_INTERNAL_MESSAGE_BYTES = 256 * MiB
DEFAULT_PUBLIC_MAX_RECEIVE_BYTES = 4 * MiB
ServerOptions = tuple[tuple[str, Any], ...]
_CONNECTION_LIMITS: ServerOptions = (
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5000),
    ("grpc.so_reuseport", 0),
    # Ping every connection every 30 s; a peer that does not answer within 10 s is gone (its
    # streams end and their requests are aborted) even when its TCP connection hangs open.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    # A connection with no RPC for 5 minutes is closed (clients reconnect transparently).
    ("grpc.max_connection_idle_ms", 300_000),
)
INTERNAL_SERVER_OPTIONS: ServerOptions = (
    ("grpc.max_send_message_length", MAX_INTERNAL_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_INTERNAL_MESSAGE_BYTES),
    *_CONNECTION_LIMITS,
)


MAX_PENDING_CALLS = 16_384
"""Calls gRPC core holds before the server's request loop takes them up. gRPC's own default
refuses past 1000 such calls at random (all past 3000), and the caller sees CANCELLED: a burst of
2000 streams on one channel lost about 1 in 10. Admission (--max-inflight-requests, the core's
queue limits) is what refuses load here, with RESOURCE_EXHAUSTED and a retry hint."""


def public_server_options(max_receive_message_bytes: int) -> ServerOptions:
    """The public port's options: bounded requests, bursts of calls taken up to
    MAX_PENDING_CALLS, and connections that are recycled after 30 minutes (GOAWAY: no new calls
    on it) with 30 more minutes for running calls to end."""
    return (
        ("grpc.max_send_message_length", MAX_INTERNAL_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", max_receive_message_bytes),
        *_CONNECTION_LIMITS,
        ("grpc.max_connection_age_ms", 1_800_000),
        ("grpc.max_connection_age_grace_ms", 1_800_000),
        ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
        ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
    )


@dataclass(frozen=True)
class Listener:
    """Everything about a service's port except its address. The default is plaintext with
    reflection, as a bare ServiceHost has always been."""

    credentials: grpc.ServerCredentials | None = None
    guard: GuardPolicy = field(default_factory=GuardPolicy)
    interceptors: tuple[Any, ...] = ()
    enable_reflection: bool = True
    health_port: int | None = None
    options: ServerOptions = INTERNAL_SERVER_OPTIONS
    plaintext_hint: str = "--tls-cert-file, --tls-key-file and --tls-ca-file"


def internal_listener(
    *,
    tls: TlsFiles | None,
    allowed_roles: Mapping[str, frozenset[str]],
    enable_reflection: bool,
    health_port: int | None,
    secret: str = "",
) -> Listener:
    """An internal port: mutual TLS when `tls` is given, where `allowed_roles` names, per gRPC
    service, the roles that may call it (health and reflection: any peer of the same CA). With
    a `secret` (--internal-secret) those services also admit only calls that present it, over
    TLS or plaintext; without TLS or a secret they are open to anyone who reaches the port."""
    admissions: dict[str, Admission] = {}
    for service, roles in allowed_roles.items():
        checks = [role_admission(roles)] if tls is not None else []
        if secret:
            checks.append(secret_admission(secret))
        if checks:
            admissions[service] = all_of(*checks)
    return Listener(
        credentials=None if tls is None else server_credentials(tls, require_client_auth=True),
        guard=GuardPolicy(admissions=admissions),
        enable_reflection=enable_reflection,
        health_port=health_port,
    )


def public_listener(
    *,
    ssl: TlsFiles | None,
    max_receive_message_bytes: int,
    interceptors: tuple[Any, ...],
    enable_reflection: bool,
    health_port: int | None,
) -> Listener:
    """The public port: TLS when `ssl` is given (client certificates required when it names a
    CA), bounded requests, errors shielded."""
    credentials = None
    if ssl is not None:
        credentials = server_credentials(ssl, require_client_auth=bool(ssl.ca_file))
    return Listener(
        credentials=credentials,
        guard=GuardPolicy(shield_errors=True),
        interceptors=interceptors,
        enable_reflection=enable_reflection,
        health_port=health_port,
        options=public_server_options(max_receive_message_bytes),
        plaintext_hint="--ssl-certfile and --ssl-keyfile",
    )


def is_loopback(host: str) -> bool:
    """Whether `host` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind(server: Any, name: str, host: str, port: int, listener: Listener) -> int:
    """Add the service's port to `server` (sync or aio); returns the bound port (0: failed)."""
    address = f"{host}:{port}"
    if listener.credentials is not None:
        return int(server.add_secure_port(address, listener.credentials))
    if not is_loopback(host):
        logger.warning(
            "%s: serving PLAINTEXT gRPC on %s: anyone who reaches this address can call it "
            "and read its traffic; give %s to encrypt it (docs/reliability.md#security)",
            name,
            address,
            listener.plaintext_hint,
        )
    return int(server.add_insecure_port(address))


async def start_aio_health_server(health: Any, host: str, port: int) -> grpc.aio.Server:
    """A plaintext server with only grpc.health.v1 (the same servicer as the main port), for
    probes that cannot present certificates (Kubernetes gRPC probes)."""
    server = grpc.aio.server(options=_CONNECTION_LIMITS)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"cannot bind the health port {host}:{port}")
    await server.start()
    return server


def start_sync_health_server(health: Any, host: str, port: int) -> grpc.Server:
    """start_aio_health_server for a synchronous service."""
    from concurrent.futures import ThreadPoolExecutor

    server = grpc.server(ThreadPoolExecutor(max_workers=4), options=_CONNECTION_LIMITS)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"cannot bind the health port {host}:{port}")
    server.start()
    return server

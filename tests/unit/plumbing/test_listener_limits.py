"""Every server's connection limits (issue 11, item 8: no server keepalive, no idle limit). These
are gRPC core options, so this checks what each listener hands gRPC; the message size limit is
seen in action in tests/security (a 5 MiB request is refused) and tests/reliability."""

from __future__ import annotations

from splitserve_runtime.listener import (
    DEFAULT_PUBLIC_MAX_RECEIVE_BYTES,
    INTERNAL_SERVER_OPTIONS,
    public_server_options,
)

KEEPALIVE_AND_IDLE = (
    "grpc.keepalive_time_ms",
    "grpc.keepalive_timeout_ms",
    "grpc.max_connection_idle_ms",
)


def test_every_server_pings_its_peers_and_closes_idle_connections() -> None:
    public = dict(public_server_options(DEFAULT_PUBLIC_MAX_RECEIVE_BYTES))
    internal = dict(INTERNAL_SERVER_OPTIONS)
    for options in (public, internal):
        assert all(options.get(name, 0) > 0 for name in KEEPALIVE_AND_IDLE), options
        assert options["grpc.keepalive_timeout_ms"] < options["grpc.keepalive_time_ms"]
    assert public["grpc.max_receive_message_length"] == 4 * 1024 * 1024
    # Public connections are recycled; the internal streams live as long as the engine.
    assert (
        public["grpc.max_connection_age_ms"] > 0 and public["grpc.max_connection_age_grace_ms"] > 0
    )
    assert "grpc.max_connection_age_ms" not in internal

"""Ports the launcher gives its children: outside the kernel's ephemeral range (where outgoing
connections take theirs), different from each other, and free."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from splitserve import loopback_ports
from splitserve.loopback_ports import (
    LINUX_EPHEMERAL_RANGE,
    LOWEST_PICKED_PORT,
    ephemeral_range,
    free_ports,
    pick_range,
)


def test_the_range_is_read_from_the_kernel_or_linux_default(tmp_path: Path) -> None:
    custom = tmp_path / "ip_local_port_range"
    custom.write_text("40000\t50000\n")
    assert ephemeral_range(custom) == (40000, 50000)
    assert ephemeral_range(tmp_path / "missing") == LINUX_EPHEMERAL_RANGE
    custom.write_text("garbage\n")
    assert ephemeral_range(custom) == LINUX_EPHEMERAL_RANGE


def test_picks_below_the_ephemeral_range_else_above_else_none() -> None:
    assert pick_range((32768, 60999)) == range(LOWEST_PICKED_PORT, 32768)
    assert pick_range((1024, 60000)) == range(60001, 65536)
    assert pick_range((1024, 65000)) is None


def test_ports_are_distinct_bindable_and_not_ephemeral() -> None:
    low, high = ephemeral_range()
    span = pick_range((low, high))
    ports = free_ports(40)
    assert len(set(ports)) == 40
    if span is not None:
        assert all(port in span for port in ports), ports
        assert not any(low <= port <= high for port in ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # raises if the port was not free


def test_a_port_in_use_is_never_given(monkeypatch: pytest.MonkeyPatch) -> None:
    base = free_ports(1)[0] // 100 * 100
    span = range(base, base + 16)
    monkeypatch.setattr(loopback_ports, "pick_range", lambda _ephemeral: span)
    holders = []
    try:
        for port in span[::2]:  # every other port of the span taken (where it was free)
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                continue
            sock.listen()
            holders.append(sock)
        taken = {s.getsockname()[1] for s in holders}
        for _ in range(20):
            picked = free_ports(4)
            assert not taken & set(picked), (taken, picked)
    finally:
        for sock in holders:
            sock.close()


def test_a_port_is_not_handed_out_again_before_its_child_binds_it() -> None:
    """Ports handed out stay unbound until their child starts: later calls (the next child's
    ports) must not return them again, though binding would find them free."""
    ports = [port for _ in range(1000) for port in free_ports(4)]
    assert len(ports) == len(set(ports)) == 4000 <= loopback_ports.RECENT_PORTS

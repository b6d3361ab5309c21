"""Free ports for the children the launcher starts on this machine.

A port the kernel hands out for `bind(0)` comes from its ephemeral range, the same range every
outgoing connection takes its local port from. Between finding such a port and the child
binding it, any connection on the machine may take it ("address already in use" at start-up,
seen on a busy CI machine). Ports below that range are never handed to connections, so they
are picked there, at random, and checked by binding them. A port handed out stays unbound until
its child starts, so this process never hands the same port out again while it is among the
last RECENT_PORTS it gave (a second call for the next child would otherwise find it free).
"""

from __future__ import annotations

import random
import socket
import threading
from collections import deque
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_EPHEMERAL_RANGE = (32768, 60999)
LOWEST_PICKED_PORT = 10000
MIN_PICK_SPAN = 1000
MAX_TRIES_PER_PORT = 50
RECENT_PORTS = 4096
_picker = random.Random()  # its own generator: tests that seed `random` must not align picks
_lock = threading.Lock()
_recent: deque[int] = deque(maxlen=RECENT_PORTS)


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's range for ports it picks itself (Linux's default where it cannot be read)."""
    try:
        low, high = (int(field) for field in path.read_text().split())
    except (OSError, ValueError):
        return LINUX_EPHEMERAL_RANGE
    return low, high


def pick_range(ephemeral: tuple[int, int]) -> range | None:
    """Ports outside `ephemeral` to pick from: below it, else above it; None when neither side
    leaves MIN_PICK_SPAN ports."""
    low, high = ephemeral
    if low - LOWEST_PICKED_PORT >= MIN_PICK_SPAN:
        return range(LOWEST_PICKED_PORT, low)
    if 65536 - (high + 1) >= MIN_PICK_SPAN:
        return range(high + 1, 65536)
    return None


def _bound(host: str, port: int) -> socket.socket | None:
    sock = socket.socket()
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        return None
    return sock


def _bind_one(host: str, span: range | None) -> socket.socket:
    if span is not None:
        for _ in range(MAX_TRIES_PER_PORT):
            port = _picker.choice(span)
            if port in _recent:
                continue
            sock = _bound(host, port)
            if sock is not None:
                return sock
    sock = socket.socket()  # no room outside the ephemeral range: let the kernel pick
    sock.bind((host, 0))
    return sock


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` different ports free on `host` right now, outside the ephemeral range where it
    leaves room (all held open together while picking, so they differ)."""
    span = pick_range(ephemeral_range())
    sockets: list[socket.socket] = []
    with _lock:
        try:
            while len(sockets) < count:
                sockets.append(_bind_one(host, span))
            ports = [int(s.getsockname()[1]) for s in sockets]
            _recent.extend(ports)
            return ports
        finally:
            for sock in sockets:
                sock.close()

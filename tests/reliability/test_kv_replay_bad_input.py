"""Malformed requests on the KV-event replay socket (issue 37): any peer that reaches it can send
them. Each is dropped; the log gets one line for the lot (main: one WARNING per request), and the
publisher goes on answering well-formed replay requests."""

from __future__ import annotations

import logging

import pytest
import zmq

from frontend_svc.kv_events import kv_publisher
from frontend_svc.kv_events.hub import AllBlocksCleared
from frontend_svc.kv_events.kv_events_config import KVEventsConfig
from frontend_svc.kv_events.kv_publisher import END_SEQ, ZmqEventPublisher
from splitserve_runtime.log_limits import RateLimitedLog

MALFORMED = [
    [b"x"],  # no delimiter
    [b"", b"\x00" * 7],  # a start sequence of 7 bytes
    [b"", b"\x00" * 9],
    [b"", b""],
    [b"", b"\x00" * 8, b"extra"],
    [b"a", b"b", b"c", b"d", b"e"],
    [b"", b"\xff" * 1000],  # under REPLAY_MAX_MESSAGE_BYTES (a larger one: the next test)
    [b"\x00" * 8],  # a start sequence without the delimiter
]


def replayed(dealer: zmq.Socket[bytes], start: int) -> list[int]:
    """The sequence numbers a well-formed replay request from `start` gets, up to the end."""
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    seqs = []
    while dealer.poll(10_000):
        frames = dealer.recv_multipart()
        assert len(frames) == 4, frames
        if frames[2] == END_SEQ:
            return seqs
        seqs.append(int.from_bytes(frames[2], "big"))
    raise AssertionError("no end marker")


def test_malformed_replay_requests_are_dropped_and_logged_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a limiter of its own (another test's line must not count) that no interval ends during
    # the test, however slow the machine (raising=False: main, which logged each, had none)
    fresh = RateLimitedLog(kv_publisher.logger, 3600)
    monkeypatch.setattr(kv_publisher, "replay_log", fresh, raising=False)
    config = KVEventsConfig(True, "zmq", "tcp://*:0", "tcp://*:0")
    publisher = ZmqEventPublisher(config, data_parallel_rank=0, block_size=2)
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect((publisher.replay_endpoint or "").replace("0.0.0.0", "127.0.0.1"))
    try:
        publisher.offer([AllBlocksCleared()])
        while not replayed(dealer, 0):  # the batch is published
            pass
        with caplog.at_level(logging.WARNING, logger=kv_publisher.logger.name):
            for _ in range(5):
                for frames in MALFORMED:  # 40 in all
                    dealer.send_multipart(frames)
            assert replayed(dealer, 0) == [0]  # after every malformed one: still served
        lines = [r for r in caplog.records if "invalid KV-event replay request" in r.message]
        assert len(lines) == 1, [r.message for r in lines]
        assert not dealer.poll(100)  # nothing was answered to a malformed request
    finally:
        context.destroy(linger=0)
        publisher.close()


def test_an_oversized_replay_message_is_dropped_by_the_socket_unread(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 16 MiB frame never reaches the publisher (main read it whole, then logged it as
    malformed): ZMQ disconnects its sender, and another peer is still served."""
    fresh = RateLimitedLog(kv_publisher.logger, 3600)
    monkeypatch.setattr(kv_publisher, "replay_log", fresh, raising=False)
    config = KVEventsConfig(True, "zmq", "tcp://*:0", "tcp://*:0")
    publisher = ZmqEventPublisher(config, data_parallel_rank=0, block_size=2)
    context = zmq.Context()
    endpoint = (publisher.replay_endpoint or "").replace("0.0.0.0", "127.0.0.1")
    hostile, dealer = context.socket(zmq.DEALER), context.socket(zmq.DEALER)
    hostile.connect(endpoint)
    dealer.connect(endpoint)
    try:
        publisher.offer([AllBlocksCleared()])
        while not replayed(dealer, 0):  # the batch is published
            pass
        with caplog.at_level(logging.WARNING, logger=kv_publisher.logger.name):
            hostile.send_multipart([b"", b"\x00" * (16 << 20)])
            assert replayed(dealer, 0) == [0]
            assert replayed(dealer, 0) == [0]
        assert not any("invalid KV-event replay" in r.message for r in caplog.records)
        assert not hostile.poll(100)
    finally:
        context.destroy(linger=0)
        publisher.close()

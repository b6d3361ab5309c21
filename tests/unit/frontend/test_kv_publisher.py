"""The ZMQ KV-event publisher on loopback: vLLM 0.32's wire layout (read back by
smg-grpc-servicer's relay decoder, an independent implementation), sequence numbers, topic,
replay from a sequence, a resync after an overflow, and the log line of a bound or a connected
endpoint."""

from __future__ import annotations

import logging
import time

import msgspec
import pytest
import zmq
from smg_grpc_servicer.kv_relay import decode_batch

from frontend_svc.kv_events.hub import AllBlocksCleared, BlockExtraKeys, BlocksRemoved, BlocksStored
from frontend_svc.kv_events.kv_events_config import KVEventsConfig
from frontend_svc.kv_events.kv_publisher import END_SEQ, ZmqEventPublisher

STORED = BlocksStored(
    [2**64 - 5, 7], None, [1, 2, 3, 4], [BlockExtraKeys("salt", (("img", 1),)), BlockExtraKeys()]
)


def local(endpoint: str) -> str:
    return endpoint.replace("0.0.0.0", "127.0.0.1")


def replay(endpoint: str, start: int) -> list[tuple[bytes, int, bytes]]:
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(local(endpoint))
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    frames = []
    try:
        while dealer.poll(5000):
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return frames
            frames.append((topic, int.from_bytes(seq, "big"), payload))
        raise AssertionError("no end marker")
    finally:
        context.destroy(linger=0)


def test_batches_are_published_in_vllms_layout_and_replayed() -> None:
    config = KVEventsConfig(True, "zmq", "tcp://*:0", "tcp://*:0", topic="kv@tiny")
    publisher = ZmqEventPublisher(config, data_parallel_rank=2, block_size=2)
    try:
        publisher.offer([AllBlocksCleared()])
        publisher.offer([STORED, BlocksRemoved([7])])
        publisher.offer([BlocksStored([9], 7, [5, 6])])
        deadline = time.monotonic() + 10
        frames: list[tuple[bytes, int, bytes]] = []
        while len(frames) < 3 and time.monotonic() < deadline:
            frames = replay(publisher.replay_endpoint or "", 0)
        assert [(topic, seq) for topic, seq, _ in frames] == [(b"kv@tiny", s) for s in range(3)]
        raw = msgspec.msgpack.decode(frames[1][2])
        assert isinstance(raw, list) and raw[2] == 2  # [ts, events, data_parallel_rank]
        assert raw[1][0]["type"] == "BlockStored" and raw[1][0]["medium"] == "GPU"
        assert raw[1][0]["extra_keys"] == [[["img", 1], "salt"], None]
        batches = [decode_batch(payload) for _, _, payload in frames]
        assert [e.kind for b in batches for e in b.events] == [
            "AllBlocksCleared", "BlockStored", "BlockRemoved", "BlockStored",
        ]  # fmt: skip
        stored = batches[1].events[0]
        assert (stored.block_hashes, stored.token_ids, stored.block_size) == (
            [-5, 7], [1, 2, 3, 4], 2,
        )  # fmt: skip
        assert stored.extra_keys == [[("multimodal", "img", 1), ("text", "salt")], None]
        assert batches[2].events[0].parent_block_hash == 7
        assert [seq for _, seq, _ in replay(publisher.replay_endpoint or "", 2)] == [2]
    finally:
        publisher.close()


def test_a_resync_replaces_what_is_queued_with_the_whole_cache() -> None:
    config = KVEventsConfig(True, "zmq", "tcp://*:0", "tcp://*:0", max_queue_size=4)
    publisher = ZmqEventPublisher(config, data_parallel_rank=0, block_size=2)
    try:
        publisher.resync([[AllBlocksCleared()], [BlocksStored([1], None, [3, 4])]])
        deadline = time.monotonic() + 10
        frames: list[tuple[bytes, int, bytes]] = []
        while len(frames) < 2 and time.monotonic() < deadline:
            frames = replay(publisher.replay_endpoint or "", 0)
        kinds = [e.kind for _, _, p in frames for e in decode_batch(p).events]
        assert kinds == ["AllBlocksCleared", "BlockStored"] and publisher.num_resyncs == 1
    finally:
        publisher.close()


def test_the_log_says_whether_the_publisher_binds_or_connects(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM's rule: an endpoint with `*` is bound; one without is connected to (a consumer
    listens there), and the log line says so."""
    context = zmq.Context()
    consumer = context.socket(zmq.SUB)
    port = consumer.bind_to_random_port("tcp://127.0.0.1")
    try:
        with caplog.at_level(logging.INFO, logger="frontend_svc.kv_events.kv_publisher"):
            for endpoint in ("tcp://*:0", f"tcp://127.0.0.1:{port}"):
                config = KVEventsConfig(True, "zmq", endpoint, None)
                ZmqEventPublisher(config, data_parallel_rank=0, block_size=2).close()
        bound, connected = (r.getMessage() for r in caplog.records)
        assert bound.startswith("publishing KV-cache events on tcp://0.0.0.0:"), bound
        assert connected.startswith(f"connecting to tcp://127.0.0.1:{port} "), connected
        assert "publishing" not in connected
    finally:
        context.destroy(linger=0)

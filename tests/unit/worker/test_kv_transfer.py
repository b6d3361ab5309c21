"""GrpcConnector ranks over real gRPC servers on loopback: a producer serves a finished
prefill's blocks, a consumer pulls them into its own blocks byte for byte; what either refuses
(layouts that differ, unknown or released transfers, wrong block ids, a peer's bad chunks), and
a cancelled pull."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from splitserve_contracts.kv.v1 import kv_transfer_pb2 as kv_pb
from splitserve_contracts.kv.v1 import kv_transfer_pb2_grpc as kv_grpc
from splitserve_runtime.channels import ChannelSecurity, open_channel
from splitserve_runtime.tls import WORKER_ROLE
from tests.fixtures.kv_peers import (
    CacheShape,
    KvPeer,
    blocks_of,
    failures,
    fill_blocks,
    finished,
    load_meta,
    make_layout,
    send_meta,
    start_peer,
)
from worker_svc.kv_connector import kv_servicer, pulls
from worker_svc.kv_connector.block_io import BlockIO
from worker_svc.kv_connector.chunk_writer import ChunkWriter, LoadFailed
from worker_svc.kv_connector.kv_convert import layout_to_proto

pytestmark = pytest.mark.timeout(60)
SHAPE = CacheShape()
TRANSFER = "ab" * 16


@pytest.fixture
def peers() -> Iterator[tuple[KvPeer, KvPeer]]:
    producer, consumer = start_peer("producer", SHAPE), start_peer("consumer", SHAPE)
    yield producer, consumer
    producer.stop()
    consumer.stop()


def segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("splitserve-kv-*")}


@pytest.mark.parametrize("shared_memory", [True, False])
def test_a_pull_copies_the_blocks_byte_for_byte(
    shared_memory: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through a shared-memory segment (both peers on this host) or in the stream: the same
    bytes, and no segment is left behind."""
    opened: list[object] = []
    real_open = kv_servicer.open_segment

    def open_segment(name: str, size: int) -> object:
        opened.append(segment := real_open(name, size))
        return segment

    monkeypatch.setattr(kv_servicer, "open_segment", open_segment)
    before = segments()
    producer = start_peer("producer", SHAPE)
    consumer = start_peer("consumer", SHAPE, shared_memory=shared_memory)
    try:
        _pull_three_blocks(producer, consumer)
    finally:
        producer.stop()
        consumer.stop()
    assert segments() == before
    assert [s is not None for s in opened] == ([True] if shared_memory else [])


def _pull_three_blocks(producer: KvPeer, consumer: KvPeer) -> None:
    fill_blocks(producer.cache, [3, 4, 5])
    producer.step(send_meta(7, TRANSFER, [3, 4, 5]))
    consumer.step(load_meta(9, producer, TRANSFER, [10, 11], [4, 5]))  # the first block is local
    consumer.wait_for(lambda r: bool(finished(r, "finished_recving") or failures(r)))
    assert failures(consumer.reports) == {}
    assert finished(consumer.reports, "finished_recving") == [9]
    assert blocks_of(consumer.cache, [10, 11]) == blocks_of(producer.cache, [4, 5])
    (out,) = consumer.reports
    assert out.num_bytes_received == 2 * SHAPE.num_layers * BlockIO(producer.cache).block_bytes
    assert out.recv_seconds > 0
    producer.wait_for(lambda r: finished(r, "finished_sending") == [7])


def test_a_pull_that_arrives_before_its_registration_waits_for_it(
    peers: tuple[KvPeer, KvPeer],
) -> None:
    producer, consumer = peers
    fill_blocks(producer.cache, [2])
    consumer.step(load_meta(1, producer, TRANSFER, [6], [2]))
    time.sleep(0.3)
    producer.step(send_meta(4, TRANSFER, [2]))  # the producer's next step registers it
    consumer.wait_for(lambda r: bool(finished(r, "finished_recving") or failures(r)))
    assert finished(consumer.reports, "finished_recving") == [1], failures(consumer.reports)
    assert blocks_of(consumer.cache, [6]) == blocks_of(producer.cache, [2])


def test_refused_pulls_name_why_and_the_rank_keeps_serving(
    peers: tuple[KvPeer, KvPeer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kv_servicer, "REGISTRATION_WAIT_SECONDS", 0.2)
    producer, consumer = peers
    released = "cd" * 16
    producer.step(send_meta(7, TRANSFER, [3, 4]))
    producer.step(send_meta(8, released, [5]))
    producer.step(kv_pb.GrpcConnectorMetadata(released_transfer_ids=[released]))
    cases = {
        1: (load_meta(1, producer, "ef" * 16, [10], [3]), "NOT_FOUND", "is unknown here"),
        2: (load_meta(2, producer, TRANSFER, [10], [3]), "INVALID_ARGUMENT", "suffix"),
        3: (load_meta(3, producer, TRANSFER, [10], [32]), "INVALID_ARGUMENT", "outside 1..31"),
        4: (load_meta(4, producer, released, [10], [5]), "NOT_FOUND", "lease ended"),
        5: (load_meta(5, producer, TRANSFER, [10], [4], "other"), "INVALID_ARGUMENT", "engine_id"),
        6: (load_meta(6, producer, TRANSFER, [0], [4]), "local_block_ids", "outside 1..31"),
    }
    for meta, _, _ in cases.values():
        consumer.step(meta)
    consumer.wait_for(lambda r: len(failures(r)) == len(cases))
    for handle, reason in failures(consumer.reports).items():
        _, code, words = cases[handle]
        assert code in reason and words in reason, reason
    assert not finished(producer.reports, "finished_sending")  # nothing was served
    consumer.step(load_meta(9, producer, TRANSFER, [10, 11], [3, 4]))
    consumer.wait_for(lambda r: 9 in finished(r, "finished_recving"))


def test_a_handshake_names_every_field_that_differs_on_one_line() -> None:
    producer = start_peer("producer", SHAPE)
    try:
        theirs = make_layout(SHAPE, block_size=32, tensor_parallel_size=2)
        with open_channel(producer.address, ChannelSecurity(None, WORKER_ROLE)) as channel:
            stub = kv_grpc.KvTransferServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.KvHandshake(kv_pb.KvHandshakeRequest(layout=layout_to_proto(theirs)))
            same = stub.KvHandshake(
                kv_pb.KvHandshakeRequest(layout=layout_to_proto(make_layout(SHAPE)))
            )
        error = info.value
        assert isinstance(error, grpc.Call)
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        details = error.details() or ""
        assert "\n" not in details
        assert "block_size 4 here, 32 there" in details
        assert "tensor_parallel_size 1 here, 2 there" in details
        assert same.engine_id == "producer" and same.layout.block_size == SHAPE.block_size
    finally:
        producer.stop()


def test_a_consumer_of_another_layout_fails_its_load_with_the_handshake_reason() -> None:
    producer = start_peer("producer", SHAPE)
    consumer = start_peer("consumer", SHAPE, layout=make_layout(SHAPE, block_size=16))
    try:
        producer.step(send_meta(7, TRANSFER, [3]))
        consumer.step(load_meta(1, producer, TRANSFER, [5], [3]))
        consumer.wait_for(lambda r: bool(failures(r)))
        reason = failures(consumer.reports)[1]
        assert "KvHandshake" in reason and "block_size 4 here, 16 there" in reason, reason
    finally:
        producer.stop()
        consumer.stop()


def test_a_cancelled_load_stops_writing_and_both_sides_report(
    peers: tuple[KvPeer, KvPeer], monkeypatch: pytest.MonkeyPatch
) -> None:
    producer, consumer = peers
    monkeypatch.setattr(pulls, "CHUNK_BYTES", BlockIO(producer.cache).block_bytes)  # 1 block
    writes: list[float] = []
    first_write = threading.Event()
    real_write = BlockIO.write

    def slow_write(self: BlockIO, layer: int, ids: object, data: bytes) -> None:
        writes.append(time.monotonic())
        first_write.set()
        time.sleep(0.05)
        real_write(self, layer, ids, data)  # type: ignore[arg-type]

    monkeypatch.setattr(BlockIO, "write", slow_write)
    blocks = list(range(1, 21))
    producer.step(send_meta(7, TRANSFER, blocks))
    consumer.step(load_meta(3, producer, TRANSFER, list(range(11, 31)), blocks))
    assert first_write.wait(5)
    cancelled_at = time.monotonic()
    consumer.step(kv_pb.GrpcConnectorMetadata(cancelled_loads=[3]))
    consumer.wait_for(lambda r: bool(failures(r)))
    assert failures(consumer.reports) == {3: "cancelled"}
    assert not finished(consumer.reports, "finished_recving")
    reported = len(writes)
    assert reported < 2 * len(blocks)  # it stopped early
    time.sleep(0.2)
    assert len(writes) == reported  # and writes nothing after its report
    producer.wait_for(lambda r: finished(r, "finished_sending") == [7], timeout=1.0)
    assert time.monotonic() - cancelled_at < 1.5
    consumer.step(kv_pb.GrpcConnectorMetadata(cancelled_loads=[3]))  # again: no second report
    consumer.step(kv_pb.GrpcConnectorMetadata(cancelled_loads=[44]))  # never loaded: at once
    assert failures(consumer.reports) == {3: "cancelled", 44: "cancelled"}


@pytest.mark.parametrize("shared_memory", [True, False])
def test_a_producer_gone_mid_pull_fails_the_load_and_leaves_no_segment(
    shared_memory: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefill engine's rank dies during the transfer: the load fails with the transport's
    reason (the engine core then computes the prompt), nothing more is written."""
    before = segments()
    producer = start_peer("producer", SHAPE)
    consumer = start_peer("consumer", SHAPE, shared_memory=shared_memory)
    monkeypatch.setattr(pulls, "CHUNK_BYTES", BlockIO(producer.cache).block_bytes)  # 1 block
    first_write = threading.Event()
    real_write = BlockIO.write

    def slow_write(self: BlockIO, layer: int, ids: object, data: bytes) -> None:
        first_write.set()
        time.sleep(0.05)
        real_write(self, layer, ids, data)  # type: ignore[arg-type]

    monkeypatch.setattr(BlockIO, "write", slow_write)
    try:
        blocks = list(range(1, 21))
        producer.step(send_meta(7, TRANSFER, blocks))
        consumer.step(load_meta(3, producer, TRANSFER, list(range(11, 31)), blocks))
        assert first_write.wait(5)
        producer.server.stop(None)  # the rank's port is gone mid-stream, as with a killed rank
        consumer.wait_for(lambda r: bool(failures(r)), timeout=10.0)
        reason = failures(consumer.reports)[3]
        assert reason.startswith("PullKv: ") and "lease" not in reason, reason
        assert not finished(consumer.reports, "finished_recving")
    finally:
        producer.stop()
        consumer.stop()
    assert segments() == before


def test_a_peers_chunks_are_checked_before_they_are_written() -> None:
    producer = start_peer("producer", SHAPE)
    try:
        blocks = BlockIO(producer.cache)
        size = blocks.block_bytes
        bad = [
            ((2, 0, 1, b"\0" * size), "this rank has 2"),
            ((0, 1, 1, b"\0" * size), "out of order"),
            ((0, 0, 3, b"\0" * 3 * size), "the load has 2"),
            ((0, 0, 1, b"\0" * (size - 1)), f"expected {size}"),
        ]
        for args, words in bad:
            writer = ChunkWriter(blocks, [5, 6])
            with pytest.raises(LoadFailed, match=words):
                writer.write(*args)
        writer = ChunkWriter(blocks, [5, 6])
        writer.write(0, 0, 2, b"\1" * 2 * size)
        with pytest.raises(LoadFailed, match="ended at layer 0 block 2 of 2 layers x 2 blocks"):
            writer.check_complete()
        assert blocks_of(producer.cache, [5]) != blocks_of(producer.cache, [7])
    finally:
        producer.stop()

"""The frontend's KV-event hub: the mirror of the engine's prefix cache, subscribers that fall
behind and are resynced from it, sinks that overflow; the core's events as the frontend reads
them; vLLM's --kv-events-config."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from frontend_svc import convert
from frontend_svc.kv_events import hub as kv_events
from frontend_svc.kv_events.hub import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KvEvent,
    KvEventHub,
)
from frontend_svc.kv_events.kv_events_config import offset_endpoint_port, parse_kv_events_config
from splitserve_contracts.core.v1 import core_service_pb2 as core_pb2
from tests.fixtures.kv_index import KvIndex

SIZE = 2


def stored(hashes: list[int], parent: int | None = None) -> BlocksStored:
    tokens = [t for h in hashes for t in (h, h + 1)]
    return BlocksStored(hashes, parent, tokens)


def rebuild(batches: list[list[KvEvent]], index: KvIndex | None = None) -> KvIndex:
    index = index or KvIndex()
    for batch in batches:
        for event in batch:
            if isinstance(event, BlocksStored):
                index.stored(event.block_hashes, event.parent_block_hash, event.token_ids, SIZE)
            elif isinstance(event, BlocksRemoved):
                index.removed(event.block_hashes)
            else:
                index.cleared()
    return index


class FullSink:
    """A sink whose queue is full after `room` batches."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.batches: list[list[KvEvent]] = []
        self.resyncs = 0

    def offer(self, events: list[KvEvent]) -> bool:
        if len(self.batches) >= self.room:
            return False
        self.batches.append(events)
        return True

    def resync(self, batches: list[list[KvEvent]]) -> None:
        self.resyncs += 1
        self.batches = list(batches)


def test_the_mirror_follows_the_events_and_a_late_subscriber_starts_from_it() -> None:
    async def scenario() -> None:
        hub = KvEventHub(SIZE)
        early = hub.subscribe()
        hub.apply([stored([10, 11, 12]), stored([20], parent=11)])
        hub.apply([BlocksRemoved([12]), stored([30, 31])])
        late = hub.subscribe()
        assert set(hub.blocks) == {10, 11, 20, 30, 31}
        early_view = rebuild(await hub.next_batches(early))  # its (empty) snapshot
        for _ in range(2):
            rebuild(await hub.next_batches(early), early_view)
        late_view = rebuild(await hub.next_batches(late))
        assert early_view.blocks == late_view.blocks
        assert late_view.blocks[20] == (11, (20, 21)), "parents come before their children"
        hub.clear()  # the stream to the core broke
        rebuild(await hub.next_batches(late), late_view)
        assert late_view.blocks == {} and hub.blocks == {}

    asyncio.run(scenario())


def test_a_subscriber_that_falls_behind_is_resynced_from_the_mirror() -> None:
    async def scenario() -> None:
        hub = KvEventHub(SIZE, max_pending_batches=3)
        subscriber = hub.subscribe()
        view = rebuild(await hub.next_batches(subscriber))
        for i in range(10):
            hub.apply([stored([100 + i])])
        assert subscriber.is_lagging and subscriber.num_resyncs == 1
        hub.apply([BlocksRemoved([100])])  # dropped: the resync covers it
        batches = await hub.next_batches(subscriber)
        assert isinstance(batches[0][0], AllBlocksCleared)
        rebuild(batches, view)
        hub.apply([stored([200])])
        rebuild(await hub.next_batches(subscriber), view)
        assert set(view.blocks) == set(hub.blocks) == {*range(101, 110), 200}

    asyncio.run(scenario())


def test_subscribers_are_bounded() -> None:
    async def scenario() -> None:
        hub = KvEventHub(SIZE)
        subscribers = [hub.subscribe() for _ in range(kv_events.MAX_SUBSCRIBERS)]
        with pytest.raises(kv_events.TooManySubscribers):
            hub.subscribe()
        hub.unsubscribe(subscribers[0])
        hub.subscribe()

    asyncio.run(scenario())


def test_a_sink_that_overflows_gets_the_whole_cache_instead() -> None:
    sink = FullSink(room=2)
    hub = KvEventHub(SIZE, sinks=[sink])
    for i in range(5):
        hub.apply([stored([i + 1])])
    assert sink.resyncs >= 1
    assert rebuild(sink.batches).blocks == rebuild(hub.snapshot()).blocks


def test_the_cores_events_are_read_as_vllm_external_hashes() -> None:
    digests = [bytes(24) + i.to_bytes(8, "big") for i in (1, 2)]
    msg = core_pb2.KvCacheEvents()
    run = msg.events.add().stored
    run.block_hashes = b"".join(digests)
    run.parent_block_hash = bytes(24) + (2**64 - 1).to_bytes(8, "big")
    run.token_ids.extend([5, 6, 7, 8])
    msg.events.add().removed.block_hashes = digests[0]
    msg.events.add().cleared.SetInParent()
    events = convert.kv_events_from_proto(msg, block_size=SIZE).events
    assert events == [
        BlocksStored([1, 2], 2**64 - 1, [5, 6, 7, 8]),
        BlocksRemoved([1]),
        AllBlocksCleared(),
    ]
    run.token_ids.append(9)  # not whole blocks
    with pytest.raises(ValueError, match="token ids"):
        convert.kv_events_from_proto(msg, block_size=SIZE)
    run.block_hashes = b"short"
    with pytest.raises(ValueError, match="32-byte"):
        convert.kv_events_from_proto(msg, block_size=SIZE)


def test_kv_events_config_reads_vllms_json() -> None:
    off = parse_kv_events_config("{}")
    assert not off.enable_kv_cache_events and off.publisher == "null" and not off.publishes_zmq
    on = parse_kv_events_config('{"enable_kv_cache_events": true, "topic": "kv"}')
    assert on.publisher == "zmq" and on.endpoint == "tcp://*:5557" and on.publishes_zmq
    grpc_only = parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}')
    assert grpc_only.enable_kv_cache_events and not grpc_only.publishes_zmq
    for bad in (
        "[]",
        "{nope",
        '{"enable_kv_cache_event": true}',
        '{"hwm": true}',
        '{"buffer_steps": 0}',
        '{"publisher": "kafka"}',
    ):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_kv_events_config(bad)


def test_endpoints_are_offset_by_the_data_parallel_rank_as_vllm_does() -> None:
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint_port("tcp://*:0", 3) == "tcp://*:0"
    assert offset_endpoint_port("inproc://kv", 2) == "inproc://kv_dp2"
    assert offset_endpoint_port(None, 2) is None
    with pytest.raises(ValueError):
        offset_endpoint_port("ipc:///tmp/kv", 1)

"""KV-cache events of the engine core: an index rebuilt from them equals the prefix cache.

The engine runs mixed traffic (shared prefixes, unique prompts, preemptions) on a KV cache far
too small for it, so blocks are cached, hit, evicted and cached again; after every step the
events are applied to a subscriber's index, which must hold exactly the cached hashes, each
with its tokens and parent. A subscriber that joins late starts from a snapshot and must agree
too; a reset and a fresh cache after a rank recovery clear it.
"""

from __future__ import annotations

import queue
import random
import threading

import pytest

from core_svc.engine.engine_core import EngineCore
from core_svc.engine.engine_inbox import EngineInbox
from core_svc.engine.engine_loop import EngineCoreProc
from core_svc.kv_cache.kv_events import BlockRemoved, BlockStored, KVEventBatch
from core_svc.outputs import EngineCoreOutputs
from tests.fixtures.kv_index import KvIndex
from tests.unit.core.fake_executor import FakeExecutor, make_engine, make_request

BLOCK_SIZE = 4
GUARD_S = 30.0


def subscribe(engine: EngineCore, client_id: int) -> KvIndex:
    index = KvIndex()
    for batch in engine.subscribe_kv_events(client_id):
        assert batch.is_snapshot
        index.apply_core_events(batch.events, BLOCK_SIZE)
    return index


def check(index: KvIndex, engine: EngineCore) -> None:
    """The index holds exactly the cached hashes; each block's tokens hash to it."""
    from core_svc.kv_cache.block_hash import hash_block_tokens

    cached = engine.kv_cache_manager.block_pool.cached_block_hash_to_block
    assert set(index.blocks) == set(cached)
    for block_hash, (parent, tokens) in index.blocks.items():
        assert hash_block_tokens(parent, list(tokens)) == block_hash


def mixed_traffic(engine: EngineCore, rng: random.Random, num_requests: int) -> None:
    prefixes = [[rng.randrange(3, 500) for _ in range(12)] for _ in range(3)]
    for handle in range(1, num_requests + 1):
        if rng.random() < 0.6:
            prompt = rng.choice(prefixes) + [rng.randrange(3, 500) for _ in range(rng.randrange(9))]
        else:
            prompt = [rng.randrange(3, 500) for _ in range(rng.randrange(1, 20))]
        engine.add_request(make_request(handle, prompt, max_tokens=rng.randrange(1, 12)))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_events_rebuild_the_cache_through_evictions(async_scheduling: bool) -> None:
    engine, _ = make_engine(
        num_blocks=20, block_size=BLOCK_SIZE, max_num_seqs=4, async_scheduling=async_scheduling
    )
    early = subscribe(engine, client_id=1)
    assert early.num_cleared == 1 and not early.blocks
    rng = random.Random(7)
    mixed_traffic(engine, rng, num_requests=40)
    late: KvIndex | None = None
    kinds: set[type] = set()
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        events = engine.kv_events.take()
        kinds.update(type(e) for e in events)
        early.apply_core_events(events, BLOCK_SIZE)
        if late is not None:
            late.apply_core_events(events, BLOCK_SIZE)
        check(early, engine)
        if steps == 15:
            late = subscribe(engine, client_id=2)
            check(late, engine)
    assert late is not None and late.blocks == early.blocks
    assert {BlockStored, BlockRemoved} <= kinds, "the run must cache and evict blocks"
    assert engine.scheduler.num_preemptions > 0, "the run must preempt"
    assert engine.reset_prefix_cache()
    early.apply_core_events(engine.kv_events.take(), BLOCK_SIZE)
    assert early.blocks == {} and early.num_cleared == 2


def test_a_fresh_cache_after_recovery_is_announced() -> None:
    engine, _ = make_engine(num_blocks=20, block_size=BLOCK_SIZE, can_recover=True)
    index = subscribe(engine, client_id=1)
    engine.add_request(make_request(1, list(range(3, 20)), max_tokens=2))
    while engine.has_work():
        engine.step()
    index.apply_core_events(engine.kv_events.take(), BLOCK_SIZE)
    assert index.blocks
    engine.on_fault(engine_fault())
    engine.resume(FakeExecutor(BLOCK_SIZE, 24), num_blocks=24)
    index.apply_core_events(engine.kv_events.take(), BLOCK_SIZE)
    assert index.blocks == {} and index.num_cleared == 2
    check(index, engine)


def engine_fault() -> object:
    from core_svc.executor.abstract import Fault

    return Fault("rank_died", "test")


def test_events_stop_with_the_last_subscriber() -> None:
    engine, _ = make_engine(block_size=BLOCK_SIZE)
    subscribe(engine, client_id=1)
    engine.abort_client(1)
    engine.add_request(make_request(1, list(range(3, 20)), client_id=2, max_tokens=2))
    while engine.has_work():
        engine.step()
    assert not engine.kv_events.is_recording and engine.kv_events.take() == []


class EventSink:
    """The loop's output sink: what each client got, in order."""

    def __init__(self) -> None:
        self.items: queue.Queue[tuple[int, EngineCoreOutputs | KVEventBatch]] = queue.Queue()

    def __call__(self, client_id: int, item: EngineCoreOutputs | KVEventBatch) -> None:
        self.items.put((client_id, item))


def test_the_loop_sends_a_snapshot_then_events_and_resets_on_command() -> None:
    engine, _ = make_engine(num_blocks=20, block_size=BLOCK_SIZE)
    sink = EventSink()
    proc = EngineCoreProc(engine, EngineInbox(), sink, lambda stats, s: None, lambda m: None)
    proc.start()
    try:
        inbox = proc.inbox
        inbox.add_requests(1, [make_request(1, list(range(3, 20)), client_id=1, max_tokens=3)])
        inbox.subscribe_kv_events(2)  # a client that adds nothing still gets the events
        index = KvIndex()
        snapshot_flags = []
        while True:
            client_id, item = sink.items.get(timeout=GUARD_S)
            if client_id == 2:
                assert isinstance(item, KVEventBatch)
                snapshot_flags.append(item.is_snapshot)
                index.apply_core_events(item.events, BLOCK_SIZE)
            elif isinstance(item, EngineCoreOutputs) and item.details:
                break  # the request finished
        assert snapshot_flags[0] and sorted(snapshot_flags, reverse=True) == snapshot_flags
        assert inbox.reset_prefix_cache().result(GUARD_S) == 0
        while index.num_cleared < 2:
            client_id, item = sink.items.get(timeout=GUARD_S)
            if client_id == 2:
                assert isinstance(item, KVEventBatch)
                index.apply_core_events(item.events, BLOCK_SIZE)
        check(index, engine)
    finally:
        proc.stop(GUARD_S)


def test_a_reset_is_refused_while_a_request_holds_blocks() -> None:
    engine, executor = make_engine(num_blocks=20, block_size=BLOCK_SIZE)
    started, release = threading.Event(), threading.Event()

    def hold(so: object) -> None:
        started.set()
        release.wait(GUARD_S)

    executor.on_execute = hold
    inbox = EngineInbox()
    proc = EngineCoreProc(engine, inbox, EventSink(), lambda stats, s: None, lambda m: None)
    proc.start()
    try:
        inbox.add_requests(1, [make_request(1, list(range(3, 20)), max_tokens=50)])
        assert started.wait(GUARD_S)
        future = inbox.reset_prefix_cache()
        release.set()
        assert future.result(GUARD_S) > 0  # refused: the request holds its blocks
    finally:
        release.set()
        proc.stop(GUARD_S)


def test_a_lagging_stream_drops_its_events_then_gets_a_snapshot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The core's outbox of a frontend that does not read: live events are dropped past the
    bound (outputs never are), and once the outbox is empty one resync is asked for; the
    snapshot it brings lets events flow again."""
    import asyncio

    from core_svc import server

    monkeypatch.setattr(server, "MAX_UNSENT_BEFORE_KV_RESYNC", 3)
    stored = BlockStored([b"a" * 32], None, [1, 2, 3, 4])

    async def scenario() -> None:
        streams = server.ClientStreams(asyncio.get_running_loop())
        client_id, outbox = streams.open()
        for step in range(5):
            streams._put(client_id, EngineCoreOutputs(step_id=step, kv_events=[stored]), 0.0)
        streams._put(client_id, KVEventBatch([stored]), 0.0)
        sent = [outbox.get_nowait()[0] for _ in range(outbox.qsize())]
        assert [type(item) for item in sent] == [EngineCoreOutputs] * 5
        assert [bool(item.kv_events) for item in sent] == [True, True, True, False, False]
        assert streams.needs_kv_resync(client_id, outbox)  # caught up: ask once
        assert not streams.needs_kv_resync(client_id, outbox)
        streams._put(client_id, KVEventBatch([stored]), 0.0)  # before the snapshot: dropped
        streams._put(client_id, KVEventBatch([], is_snapshot=True), 0.0)
        streams._put(client_id, KVEventBatch([stored]), 0.0)
        kinds = [outbox.get_nowait()[0].is_snapshot for _ in range(outbox.qsize())]
        assert kinds == [True, False]

    asyncio.run(scenario())

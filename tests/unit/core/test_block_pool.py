"""BlockPool and its LRU free queue."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from core_svc.kv_cache import kv_events
from core_svc.kv_cache.block_hash import hash_block_tokens
from core_svc.kv_cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from core_svc.kv_cache.kv_events import BlockExtraKeys, BlockRemoved, BlockStored, KVEventRecorder
from core_svc.lora import LoraRequest
from core_svc.mm_inputs import MultiModalFeatureSpec
from tests.fixtures.kv_index import KvIndex
from tests.unit.core.kv_helpers import free_block_ids

BLOCK_SIZE = 2


class Sequence:
    """The token ids (and hash inputs) whose blocks a test caches."""

    def __init__(self, num_blocks: int = 64, cache_salt: str = "") -> None:
        self.all_token_ids = list(range(100, 100 + num_blocks * BLOCK_SIZE))
        self.cache_salt = cache_salt
        self.mm_features: tuple[MultiModalFeatureSpec, ...] = ()
        self.lora: LoraRequest | None = None


SEQ = Sequence()


def make_pool(num_blocks: int, enable_caching: bool = True) -> BlockPool:
    return BlockPool(num_blocks, enable_caching, KVEventRecorder(num_blocks, BLOCK_SIZE))


def free_ids(pool: BlockPool) -> list[int]:
    return free_block_ids(pool.free_block_queue)


def test_free_queue_pops_appends_and_removes_from_the_middle() -> None:
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert [b.block_id for b in queue.popleft_n(2)] == [0, 1]
    queue.remove(blocks[3])
    assert free_block_ids(queue) == [2, 4, 5]
    queue.append(blocks[0])
    assert queue.popleft().block_id == 2
    assert free_block_ids(queue) == [4, 5, 0]
    assert queue.num_free_blocks == 3
    with pytest.raises(ValueError):
        queue.remove(blocks[3])
    with pytest.raises(ValueError):
        queue.popleft_n(4)


def test_null_block_is_reserved_and_idle_usage_is_zero() -> None:
    pool = make_pool(5)
    assert free_ids(pool) == [1, 2, 3, 4]
    assert pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(4)
    assert [b.block_id for b in blocks] == [1, 2, 3, 4]
    assert pool.get_usage() == 1.0
    pool.free_blocks(blocks)
    assert pool.get_usage() == 0.0
    assert pool.get_num_used_blocks() == 0


def test_freed_blocks_keep_their_hash_until_reused() -> None:
    pool = make_pool(4)
    blocks = pool.get_new_blocks(2)
    hashes = [hash_block_tokens(None, [1, 2]), hash_block_tokens(None, [3, 4])]
    pool.cache_full_blocks(SEQ, blocks, hashes, 0, 2)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 2, 1]
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert pool.get_cached_block(hashes[1]) is blocks[1]
    # The head (block 3, never cached) goes first, then the earliest freed (block 2).
    taken = pool.get_new_blocks(2)
    assert [b.block_id for b in taken] == [3, 2]
    assert pool.get_cached_block(hashes[1]) is None
    assert blocks[1].block_hash is None
    assert pool.get_cached_block(hashes[0]) is blocks[0]


def test_touch_takes_free_cached_blocks_out_of_the_queue() -> None:
    pool = make_pool(4)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(SEQ, [block], [b"h" * 32], 0, 1)
    pool.free_blocks([block])
    assert pool.get_num_free_blocks() == 3
    pool.touch([block])
    pool.touch([block])
    assert block.ref_cnt == 2
    assert block.block_id not in free_ids(pool)
    pool.free_blocks([block])
    assert block.block_id not in free_ids(pool)
    pool.free_blocks([block])
    assert free_ids(pool)[-1] == block.block_id


def test_duplicate_hash_stays_unregistered() -> None:
    pool = make_pool(4)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_blocks(SEQ, [first], [b"x" * 32], 0, 1)
    pool.cache_full_blocks(SEQ, [second], [b"x" * 32], 0, 1)
    assert pool.get_cached_block(b"x" * 32) is first
    assert second.block_hash is None


def test_reset_prefix_cache_only_when_idle() -> None:
    pool = make_pool(4)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(SEQ, [block], [b"y" * 32], 0, 1)
    assert not pool.reset_prefix_cache()
    pool.free_blocks([block])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(b"y" * 32) is None
    assert block.block_hash is None


def test_double_free_is_detected() -> None:
    pool = make_pool(3, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError):
        pool.free_blocks([block])


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / cache / hit / free sequences against a model of the holders."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = make_pool(9)
        self.holdings: list[list[KVCacheBlock]] = []
        self.next_hash = 0
        # A subscriber's view, rebuilt from the events alone (and the tokens each hash holds).
        self.index = KvIndex()
        self.index.apply_core_events(self._snapshot_events(), BLOCK_SIZE)
        self.tokens: dict[bytes, tuple[int, ...]] = {}

    def _snapshot_events(self) -> list[object]:
        batches = self.pool.kv_events.subscribe(1, self.pool.cached_block_hash_to_block)
        return [event for batch in batches for event in batch.events]

    @rule(n=st.integers(1, 4))
    def allocate(self, n: int) -> None:
        if n <= self.pool.get_num_free_blocks():
            self.holdings.append(self.pool.get_new_blocks(n))

    @precondition(lambda self: self.holdings)
    @rule(index=st.integers(0, 100))
    def cache(self, index: int) -> None:
        blocks = self.holdings[index % len(self.holdings)]
        hashes = []
        for i, _ in enumerate(blocks):
            self.next_hash += 1
            hashes.append(self.next_hash.to_bytes(32, "little"))
            self.tokens[hashes[-1]] = tuple(
                SEQ.all_token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
            )
        self.pool.cache_full_blocks(SEQ, blocks, hashes, 0, len(blocks))

    @rule(index=st.integers(0, 100))
    def hit(self, index: int) -> None:
        cached = list(self.pool.cached_block_hash_to_block.values())
        if cached:
            block = cached[index % len(cached)]
            self.pool.touch([block])
            self.holdings.append([block])

    @precondition(lambda self: self.holdings)
    @rule(index=st.integers(0, 100))
    def free(self, index: int) -> None:
        blocks = self.holdings.pop(index % len(self.holdings))
        self.pool.free_blocks(reversed(blocks))

    @rule()
    def reset(self) -> None:
        assert self.pool.reset_prefix_cache() == (not self.holdings)

    @rule()
    def resubscribe(self) -> None:
        """A subscriber that fell behind starts again from a snapshot."""
        self.index = KvIndex()
        self.index.apply_core_events(self._snapshot_events(), BLOCK_SIZE)

    @invariant()
    def events_rebuild_the_cache(self) -> None:
        self.index.apply_core_events(self.pool.kv_events.take(), BLOCK_SIZE)
        cached = self.pool.cached_block_hash_to_block
        assert set(self.index.blocks) == set(cached)
        for block_hash, (_, tokens) in self.index.blocks.items():
            assert tokens == self.tokens[block_hash]

    @invariant()
    def counts_match_holders(self) -> None:
        pool = self.pool
        holders: dict[int, int] = {}
        for blocks in self.holdings:
            for block in blocks:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        free = free_ids(pool)
        assert len(free) == pool.get_num_free_blocks()
        assert pool.get_num_free_blocks() + len(holders) == pool.num_usable_blocks
        assert 0 not in free and pool.null_block.ref_cnt == 0
        for block in pool.blocks[1:]:
            assert block.ref_cnt == holders.get(block.block_id, 0) >= 0
            assert (block.ref_cnt == 0) == (block.block_id in free)
        for block_hash, block in pool.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash
        if not self.holdings:
            assert pool.get_usage() == 0.0


TestBlockPoolMachine = BlockPoolMachine.TestCase


def test_a_run_ends_at_a_duplicate_and_the_next_names_it_as_parent() -> None:
    pool = make_pool(8)
    pool.kv_events.subscribe(1, {})
    first = pool.get_new_blocks(1)
    pool.cache_full_blocks(SEQ, first, [b"b" * 32], 0, 1)  # another sequence holds "b"
    blocks = pool.get_new_blocks(4)
    hashes = [b"a" * 32, b"b" * 32, b"c" * 32, b"d" * 32]
    pool.cache_full_blocks(SEQ, blocks, hashes, 0, 4)
    events = pool.kv_events.take()
    stored = [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in events]  # type: ignore[union-attr]
    tokens = SEQ.all_token_ids
    assert stored == [
        ([b"b" * 32], None, tokens[0:2]),
        ([b"a" * 32], None, tokens[0:2]),
        ([b"c" * 32, b"d" * 32], b"b" * 32, tokens[4:8]),
    ]
    assert blocks[1].block_hash is None  # the duplicate itself stays unregistered


def test_evictions_coalesce_and_reset_clears() -> None:
    pool = make_pool(4)
    pool.kv_events.subscribe(1, {})
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(SEQ, blocks, [b"a" * 32, b"b" * 32, b"c" * 32], 0, 3)
    pool.free_blocks(blocks)
    pool.kv_events.take()
    pool.get_new_blocks(2)
    (removed,) = pool.kv_events.take()
    assert removed == BlockRemoved([b"a" * 32, b"b" * 32])
    assert not pool.reset_prefix_cache()  # blocks in use: refused, no event
    assert pool.kv_events.take() == []


def test_extra_keys_carry_the_salt_and_images() -> None:
    pool = make_pool(8)
    pool.kv_events.subscribe(1, {})
    sequence = Sequence(cache_salt="tenant-a")
    sequence.mm_features = (MultiModalFeatureSpec("img", offset=3, length=2),)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(sequence, blocks, [b"a" * 32, b"b" * 32, b"c" * 32], 0, 3)
    (stored,) = pool.kv_events.take()
    assert isinstance(stored, BlockStored)
    assert stored.extra_keys == [
        BlockExtraKeys("tenant-a", ()),
        BlockExtraKeys("", (("img", 1),)),
        BlockExtraKeys("", (("img", -1),)),
    ]
    snapshot = pool.kv_events.snapshot(pool.cached_block_hash_to_block)
    assert snapshot[0].events[1] == stored


def test_snapshot_lists_parents_first_in_bounded_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_events, "MAX_SNAPSHOT_BLOCKS_PER_BATCH", 2)
    pool = make_pool(8)
    pool.kv_events.subscribe(1, {})
    blocks = pool.get_new_blocks(5)
    hashes = [bytes([i]) * 32 for i in range(5)]
    pool.cache_full_blocks(SEQ, blocks, hashes, 3, 5)  # children cached first
    pool.cache_full_blocks(SEQ, blocks, hashes, 0, 3)
    batches = pool.kv_events.snapshot(pool.cached_block_hash_to_block)
    assert all(batch.is_snapshot for batch in batches)
    assert [len(b.events) for b in batches] == [2, 1, 1]
    index = KvIndex()
    for batch in batches:
        index.apply_core_events(batch.events, BLOCK_SIZE)
    assert list(index.blocks) == hashes
    assert index.blocks[hashes[3]] == (hashes[2], tuple(SEQ.all_token_ids[6:8]))


TestBlockPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_nothing_is_kept_before_the_first_subscription() -> None:
    """An engine nobody subscribed to pays nothing; the blocks it cached then stay out of the
    first subscriber's view (and their eviction is not announced) until cached again."""
    pool = make_pool(5)
    early = pool.get_new_blocks(2)
    pool.cache_full_blocks(SEQ, early, [b"a" * 32, b"b" * 32], 0, 2)
    assert not pool.kv_events.keeps_blocks
    (snapshot,) = pool.kv_events.subscribe(1, pool.cached_block_hash_to_block)
    assert snapshot.events == [kv_events.AllBlocksCleared()]
    late = pool.get_new_blocks(2)
    pool.cache_full_blocks(SEQ, late, [b"c" * 32, b"d" * 32], 0, 2)
    pool.free_blocks(early + late)
    pool.get_new_blocks(4)  # evicts all four
    events = pool.kv_events.take()
    assert events[-1] == BlockRemoved([b"c" * 32, b"d" * 32])

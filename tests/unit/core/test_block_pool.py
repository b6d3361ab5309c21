"""BlockPool and its LRU free queue."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from core_svc.block_hash import hash_block_tokens
from core_svc.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from tests.unit.core.kv_helpers import free_block_ids


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
    pool = BlockPool(num_blocks=5, enable_caching=True)
    assert free_ids(pool) == [1, 2, 3, 4]
    assert pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(4)
    assert [b.block_id for b in blocks] == [1, 2, 3, 4]
    assert pool.get_usage() == 1.0
    pool.free_blocks(blocks)
    assert pool.get_usage() == 0.0
    assert pool.get_num_used_blocks() == 0


def test_freed_blocks_keep_their_hash_until_reused() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    hashes = [hash_block_tokens(None, [1, 2]), hash_block_tokens(None, [3, 4])]
    pool.cache_full_blocks(blocks, hashes, 0, 2)
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
    pool = BlockPool(num_blocks=4, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [b"h" * 32], 0, 1)
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
    pool = BlockPool(num_blocks=4, enable_caching=True)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_blocks([first], [b"x" * 32], 0, 1)
    pool.cache_full_blocks([second], [b"x" * 32], 0, 1)
    assert pool.get_cached_block(b"x" * 32) is first
    assert second.block_hash is None


def test_double_free_is_detected() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError):
        pool.free_blocks([block])


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / cache / hit / free sequences against a model of the holders."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(num_blocks=9, enable_caching=True)
        self.holdings: list[list[KVCacheBlock]] = []
        self.next_hash = 0

    @rule(n=st.integers(1, 4))
    def allocate(self, n: int) -> None:
        if n <= self.pool.get_num_free_blocks():
            self.holdings.append(self.pool.get_new_blocks(n))

    @precondition(lambda self: self.holdings)
    @rule(index=st.integers(0, 100))
    def cache(self, index: int) -> None:
        blocks = self.holdings[index % len(self.holdings)]
        hashes = []
        for _ in blocks:
            self.next_hash += 1
            hashes.append(self.next_hash.to_bytes(32, "little"))
        self.pool.cache_full_blocks(blocks, hashes, 0, len(blocks))

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
TestBlockPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)

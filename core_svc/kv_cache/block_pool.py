"""KV blocks, their LRU free queue and the prefix-cache hash map (vLLM's BlockPool)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from core_svc.kv_cache.block_hash import BlockHash
from core_svc.kv_cache.kv_events import CachedSequence, KVEventRecorder


class KVCacheBlock:
    """One KV block. `block_hash` is set once the block is full and cached, and kept after
    the block is freed (it stays hit-able) until the block is reused for other tokens."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks, in eviction order (head = least recently freed).

    Links live inside the blocks and two sentinels bound the list, so popping, appending
    and removing a block from the middle (a prefix hit on a free block) are O(1) and
    allocate nothing; a deque would need an O(n) scan to remove.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self._tail
        self._tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is None or block is self._tail:
            raise ValueError("no free block")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, have {self.num_free_blocks}")
        blocks = []
        block = self._head.next_free_block
        for _ in range(n):
            assert block is not None
            blocks.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        assert block is not None
        self._head.next_free_block = block
        block.prev_free_block = self._head
        self.num_free_blocks -= n
        return blocks

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1


class BlockPool:
    """All KV blocks of the cache.

    Block 0 is the null block: reserved at start-up and never handed out or counted, so
    workers may use it as a padding target. Invariants: a block is in the free queue iff
    its ref_cnt is 0; `cached_block_hash_to_block[h].block_hash == h`; a block with a
    hash that is not in the map (a duplicate of a cached block) cannot exist. Every change
    to the map is reported to `kv_events` (vLLM's kv_event_queue).
    """

    def __init__(self, num_blocks: int, enable_caching: bool, kv_events: KVEventRecorder) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.kv_events = kv_events
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_num_used_blocks(self) -> int:
        return self.num_blocks - 1 - self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks held by requests; exactly 0.0 when none are."""
        return self.get_num_used_blocks() / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop blocks from the free-queue head, evicting their cached hashes; ref_cnt = 1."""
        blocks = self.free_block_queue.popleft_n(num_blocks)
        cached = self.cached_block_hash_to_block
        events = self.kv_events
        for block in blocks:
            if block.block_hash is not None:
                del cached[block.block_hash]
                if events.is_recording:
                    events.removed(block.block_id, block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling free ones out of the free queue."""
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 go to the free-queue tail in the given
        order (first = evicted first), keeping their hash."""
        queue = self.free_block_queue
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                queue.append(block)
            elif block.ref_cnt < 0:
                raise AssertionError(f"{block} freed more often than allocated")

    def cache_full_blocks(
        self,
        sequence: CachedSequence,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Register blocks[num_cached_blocks:num_full_blocks] of `sequence` under their hashes.
        A block whose hash another block already holds stays unregistered (a duplicate); each
        run of newly registered blocks goes to `kv_events`."""
        cached = self.cached_block_hash_to_block
        run_start = -1
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            block_hash = block_hashes[i]
            if (
                block.block_hash is None
                and block is not self.null_block
                and block_hash not in cached
            ):
                block.block_hash = block_hash
                cached[block_hash] = block
                if run_start < 0:
                    run_start = i
            elif run_start >= 0:
                self.kv_events.stored(sequence, blocks, block_hashes, run_start, i)
                run_start = -1
        if run_start >= 0:
            self.kv_events.stored(sequence, blocks, block_hashes, run_start, num_full_blocks)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.get_num_used_blocks() > 0:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        self.kv_events.cleared()
        return True

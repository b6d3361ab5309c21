"""What the tests read of the KV block pool that the engine itself never needs."""

from __future__ import annotations

from core_svc.kv_cache.block_pool import FreeKVCacheBlockQueue


def free_block_ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    """The free queue's block ids from head (evicted first) to tail."""
    ids = []
    block = queue._head.next_free_block
    while block is not None and block is not queue._tail:
        ids.append(block.block_id)
        block = block.next_free_block
    return ids

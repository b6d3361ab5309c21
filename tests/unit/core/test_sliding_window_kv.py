"""KVCacheManager with a sliding window: blocks below the next query's window are freed and
become the null block in the request's table; freeing, caching and hits stay consistent."""

from __future__ import annotations

from core_svc.kv_cache.kv_cache_manager import KVCacheManager
from tests.unit.core.test_kv_cache_manager import BLOCK_SIZE, add, compute_prompt


def windowed(num_blocks: int = 12, window: int = 6) -> KVCacheManager:
    return KVCacheManager(
        num_blocks, BLOCK_SIZE, max_model_len=64, enable_caching=True, sliding_window=window
    )


def test_blocks_below_the_window_are_freed_before_the_next_allocation() -> None:
    kv = windowed()
    request = add(1, list(range(10)))
    compute_prompt(kv, request)  # 10 tokens in 3 blocks
    assert kv.block_pool.get_num_used_blocks() == 3
    # Next query at position 10 sees keys 5..10: block 0 (tokens 0-3) is out of the window.
    assert kv.allocate_slots(request, 1) == ()
    blocks = kv.get_blocks(request)
    assert blocks[0] is kv.block_pool.null_block and len(blocks) == 3
    assert kv.block_pool.get_num_used_blocks() == 2
    request.num_computed_tokens = 15
    new = kv.allocate_slots(request, 1)  # position 15 sees 10..15: block 1 goes, 2 stays
    assert new is not None and len(new) == 1
    null = kv.block_pool.null_block
    assert [b is null for b in kv.get_blocks(request)] == [True, True, False, False]
    assert kv.block_pool.get_num_used_blocks() == 2


def test_freeing_a_windowed_request_skips_the_null_entries() -> None:
    kv = windowed()
    request = add(1, list(range(12)))
    compute_prompt(kv, request)
    request.num_computed_tokens = 12
    kv.allocate_slots(request, 1)
    kv.free(request)
    pool = kv.block_pool
    assert pool.get_num_used_blocks() == 0 and pool.null_block.ref_cnt == 0
    assert pool.null_block.block_hash is None


def test_freed_blocks_stay_prefix_hits_until_reused() -> None:
    """A block freed out of the window keeps its hash: a new request with the same prefix
    still hits the whole chain."""
    kv = windowed()
    first = add(1, list(range(12)) + [50])
    compute_prompt(kv, first)
    first.num_computed_tokens = 13
    kv.allocate_slots(first, 1)
    assert kv.get_blocks(first)[0] is kv.block_pool.null_block
    blocks, num_hits = kv.get_computed_blocks(add(2, list(range(12)) + [60]))
    assert num_hits == 12 and all(b is not kv.block_pool.null_block for b in blocks)


def test_without_a_window_nothing_is_freed_early() -> None:
    kv = windowed(window=0)
    request = add(1, list(range(12)))
    compute_prompt(kv, request)
    request.num_computed_tokens = 12
    kv.allocate_slots(request, 1)
    assert kv.block_pool.null_block not in kv.get_blocks(request)

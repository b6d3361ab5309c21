"""KVCacheManager: prefix lookups, allocate_slots accounting, reverse-order free."""

from __future__ import annotations

from typing import Any

import pytest

from core_svc.kv_cache.block_hash import BlockHasher
from core_svc.kv_cache.kv_cache_manager import KVCacheManager
from core_svc.request import Request
from tests.unit.core.fake_executor import make_request
from tests.unit.core.kv_helpers import free_block_ids

BLOCK_SIZE = 4


def new_manager(num_blocks: int = 9, enable_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK_SIZE, max_model_len=64, enable_caching=enable_caching)


def add(handle: int, prompt: list[int], salt: str = "", **sampling: Any) -> Request:
    request = make_request(handle, prompt, cache_salt=salt, **sampling)
    request.req_handle = handle
    BlockHasher(BLOCK_SIZE).extend(request.block_hashes, request.all_token_ids, salt)
    return request


def compute_prompt(kv: KVCacheManager, request: Request) -> None:
    """Admit the request, compute its whole prompt and cache the full blocks."""
    blocks, num_hits = kv.get_computed_blocks(request)
    num_new = request.num_tokens - num_hits
    assert kv.allocate_slots(request, num_new, num_hits, blocks) is not None
    request.num_computed_tokens = request.num_tokens
    kv.cache_blocks(request, request.num_computed_tokens)


def test_hits_stop_at_the_first_miss_and_never_cover_the_whole_prompt() -> None:
    kv = new_manager()
    first = add(1, list(range(12)))
    compute_prompt(kv, first)
    assert kv.get_computed_blocks(add(2, list(range(12)) + [99]))[1] == 12
    # A prompt made only of cached blocks recomputes its last block.
    blocks, num_hits = kv.get_computed_blocks(add(3, list(range(12))))
    assert num_hits == 8
    assert blocks == kv.get_blocks(first)[:2]
    assert kv.get_computed_blocks(add(4, [0, 1, 2, 3, 9, 9, 9, 9, 9]))[1] == 4


def test_no_hits_when_caching_is_off_or_prompt_logprobs_are_wanted() -> None:
    kv = new_manager()
    compute_prompt(kv, add(1, list(range(12))))
    assert kv.get_computed_blocks(add(2, list(range(13)), prompt_logprobs=0)) == ([], 0)
    off = new_manager(enable_caching=False)
    compute_prompt(off, add(1, list(range(12))))
    assert off.get_computed_blocks(add(2, list(range(13)))) == ([], 0)
    assert off.block_pool.cached_block_hash_to_block == {}


def test_salt_isolates_cached_blocks() -> None:
    kv = new_manager()
    compute_prompt(kv, add(1, list(range(12)), salt="alice"))
    assert kv.get_computed_blocks(add(2, list(range(13)), salt="bob"))[1] == 0
    assert kv.get_computed_blocks(add(3, list(range(13))))[1] == 0
    assert kv.get_computed_blocks(add(4, list(range(13)), salt="alice"))[1] == 12


def test_evictable_hit_blocks_count_against_free_blocks() -> None:
    kv = new_manager(num_blocks=5)  # 4 usable
    first = add(1, list(range(8)))
    compute_prompt(kv, first)
    kv.free(first)
    assert kv.block_pool.get_num_free_blocks() == 4
    second = add(2, list(range(8)) + list(range(100, 109)))  # 17 tokens: 5 blocks
    blocks, num_hits = kv.get_computed_blocks(second)
    assert num_hits == 8
    # 2 evictable hits + 3 new blocks > 4 free.
    assert not kv.can_allocate(second, 9, num_hits, blocks)
    assert kv.allocate_slots(second, 9, num_hits, blocks) is None
    assert kv.block_pool.get_num_free_blocks() == 4
    assert all(b.ref_cnt == 0 for b in blocks)
    # A chunk of 8 fits (2 hits + 2 new), but not when the whole sequence must fit.
    assert kv.allocate_slots(second, 8, num_hits, blocks, full_sequence_must_fit=True) is None
    new_blocks = kv.allocate_slots(second, 8, num_hits, blocks)
    assert new_blocks is not None and len(new_blocks) == 2
    assert [b.ref_cnt for b in kv.get_blocks(second)] == [1, 1, 1, 1]
    assert kv.block_pool.get_num_free_blocks() == 0


def test_allocate_slots_returns_only_new_blocks() -> None:
    kv = new_manager()
    request = add(1, list(range(6)))
    first = kv.allocate_slots(request, 6)
    assert first is not None and len(first) == 2
    request.num_computed_tokens = 6
    assert kv.allocate_slots(request, 2) == ()
    request.num_computed_tokens = 8
    more = kv.allocate_slots(request, 1)
    assert more is not None and len(more) == 1
    assert kv.get_block_ids(request) == [b.block_id for b in [*first, *more]]
    with pytest.raises(ValueError):
        kv.allocate_slots(request, 0)


def test_only_fully_computed_blocks_are_cached() -> None:
    kv = new_manager()
    request = add(1, list(range(10)))
    assert kv.allocate_slots(request, 10) is not None
    request.num_computed_tokens = 7
    kv.cache_blocks(request, 7)
    assert len(kv.block_pool.cached_block_hash_to_block) == 1
    request.num_computed_tokens = 10
    kv.cache_blocks(request, 10)
    assert len(kv.block_pool.cached_block_hash_to_block) == 2


def test_free_releases_tail_blocks_first() -> None:
    kv = new_manager()
    request = add(1, list(range(12)))
    compute_prompt(kv, request)
    ids = kv.get_block_ids(request)
    kv.free(request)
    free = free_block_ids(kv.block_pool.free_block_queue)
    assert free[-3:] == ids[::-1]
    assert kv.usage == 0.0
    assert kv.get_block_ids(request) == []


def test_prefix_cache_stats_are_in_tokens_and_split_by_preemption() -> None:
    kv = new_manager()
    request = add(1, list(range(9)))
    kv.record_prefix_cache_stats(request, 4)
    request.num_preemptions = 1
    kv.record_prefix_cache_stats(request, 8)
    stats = kv.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (1, 9, 4)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 9, 8)

"""Which KV blocks each request holds, and the prefix-cache lookups (vLLM's KVCacheManager).

The cache groups (vLLM's hybrid allocator, with a pool per group): the attention group, whose
blocks every attention layer shares (full attention, or a sliding window every attention layer
has), and for a model with state layers the state group (state_group.py: one slot per request).
A request's blocks and its slot are allocated together (all or nothing), freed and preempted
together; `usage` is the fuller group's.

With a sliding window w, a running request's blocks that hold only tokens no future query can
see (positions below num_computed_tokens - w + 1) are freed before each allocation and their
table entries become the null block (vLLM's SlidingWindowManager.remove_skipped_blocks). The
workers keep their own copies of the block tables, whose stale entries the attention masks
out. Admission still asks for room for the whole prompt, and prefix-cache hits still need the
whole chain from the first block: both stay as without a window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

from core_svc.kv_cache.block_pool import BlockPool, KVCacheBlock
from core_svc.kv_cache.kv_events import KVEventRecorder
from core_svc.kv_cache.state_group import StateSlotPool
from core_svc.request import Request

_NO_BLOCKS: tuple[KVCacheBlock, ...] = ()


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups in tokens, counted once per admission of a request with no
    computed tokens; re-admissions after a preemption count in the preempted_* fields."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


class KVCacheManager:
    """Allocates, caches and frees the KV blocks of requests.

    Token layout of a request when slots are allocated:

        | computed | new computed (prefix hits) | new tokens to compute | (unallocated) |
        |<-- blocks already held -->|<- touched ->|<-- new blocks, ceil -->|

    Invariant: a request's blocks cover at least its computed tokens plus the tokens
    scheduled for the current step; blocks are cached (hash registered) only once every
    token in them is computed, so a prefix hit never points at KV still being written.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool,
        sliding_window: int = 0,
        num_state_slots: int = 0,
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.kv_events = KVEventRecorder(num_blocks, block_size)
        """What happens to the prefix cache, for the frontends that subscribe."""
        self.block_pool = BlockPool(num_blocks, enable_caching, self.kv_events)
        self.req_to_blocks: dict[int, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[int, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        self.num_state_slots = num_state_slots
        self.state_slots = StateSlotPool(num_state_slots) if num_state_slots else None
        """The state group (None: the model has no state layers)."""
        if self.state_slots is not None and enable_caching:
            raise ValueError("prefix caching cannot be on for a model with state layers")

    @property
    def usage(self) -> float:
        """The fuller group's usage (the one that limits admission)."""
        usage = self.block_pool.get_usage()
        if self.state_slots is not None:
            usage = max(usage, self.state_slots.get_usage())
        return usage

    def group_usages(self) -> dict[str, float]:
        """Each cache group's usage, by group name."""
        usages = {"attention": self.block_pool.get_usage()}
        if self.state_slots is not None:
            usages["state"] = self.state_slots.get_usage()
        return usages

    def get_state_slot(self, request: Request) -> int:
        """The request's state slot (0: none, or the model has no state layers)."""
        return 0 if self.state_slots is None else self.state_slots.get(request.req_handle)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest chain of cached blocks matching the request's prefix, and the tokens they
        cover. The last token is never counted: it must be computed to produce logits."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        max_num_hit_blocks = (request.num_tokens - 1) // self.block_size
        lookup = self.block_pool.cached_block_hash_to_block.get
        blocks = []
        for block_hash in islice(request.block_hashes, max_num_hit_blocks):
            block = lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def record_prefix_cache_stats(self, request: Request, num_hit_tokens: int) -> None:
        """Count one admission's lookup (the caller admitted a request with 0 computed)."""
        if self.enable_caching:
            preempted = request.num_preemptions > 0
            self.prefix_cache_stats.record(request.num_tokens, num_hit_tokens, preempted)

    def can_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] = _NO_BLOCKS,
        full_sequence_must_fit: bool = False,
    ) -> bool:
        num_needed = self._get_num_blocks_to_allocate(
            request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
            full_sequence_must_fit,
        )  # fmt: skip
        state = self.state_slots
        if state is not None and state.num_needed(request.req_handle) > state.num_free_slots:
            return False
        return num_needed <= self.block_pool.get_num_free_blocks()

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] = _NO_BLOCKS,
        full_sequence_must_fit: bool = False,
    ) -> Sequence[KVCacheBlock] | None:
        """Give the request slots for num_new_tokens more tokens after its computed and
        newly hit ones; returns only the newly allocated blocks, or None (nothing changed)
        when the free blocks do not suffice. With full_sequence_must_fit the request's whole
        current sequence must fit (the admission gate against over-admitting chunks)."""
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be > 0, got {num_new_tokens}")
        req_blocks = self.req_to_blocks.get(request.req_handle)
        if req_blocks is not None and not new_computed_blocks and not full_sequence_must_fit:
            if self.sliding_window:
                self.remove_skipped_blocks(req_blocks, request.num_computed_tokens)
            num_tokens = request.num_computed_tokens + num_new_tokens
            if num_tokens > self.max_model_len:
                num_tokens = self.max_model_len
            num_new_blocks = -(-num_tokens // self.block_size) - len(req_blocks)
            if num_new_blocks <= 0:
                return _NO_BLOCKS
            if num_new_blocks > self.block_pool.free_block_queue.num_free_blocks:
                return None
            new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
            req_blocks.extend(new_blocks)
            return new_blocks
        if not self.can_allocate(
            request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
            full_sequence_must_fit,
        ):  # fmt: skip
            return None
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request.req_handle] = []
            self.num_cached_blocks[request.req_handle] = 0
        if self.state_slots is not None:
            self.state_slots.allocate(request.req_handle)
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            self.num_cached_blocks[request.req_handle] = len(req_blocks)
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_tokens = min(num_tokens, self.max_model_len)
        num_new_blocks = -(-num_tokens // self.block_size) - len(req_blocks)
        if num_new_blocks <= 0:
            return _NO_BLOCKS
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        return new_blocks

    def remove_skipped_blocks(self, req_blocks: list[KVCacheBlock], num_computed: int) -> None:
        """Free the blocks below the window of the next query (position `num_computed`), latest
        first, so the earliest (most shareable prefix) blocks are evicted last."""
        num_skipped_tokens = num_computed - self.sliding_window + 1
        null_block = self.block_pool.null_block
        removed = []
        for i in range(min(num_skipped_tokens // self.block_size, len(req_blocks)) - 1, -1, -1):
            if req_blocks[i] is null_block:
                break  # the earlier ones went before
            removed.append(req_blocks[i])
            req_blocks[i] = null_block
        self.block_pool.free_blocks(removed)

    def _get_num_blocks_to_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        full_sequence_must_fit: bool,
    ) -> int:
        """Free blocks the allocation would consume: new blocks, plus hit blocks that sit
        in the free queue (touching them takes them out of it)."""
        if full_sequence_must_fit:
            num_tokens = request.num_tokens
        else:
            num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_tokens = min(num_tokens, self.max_model_len)
        num_held = len(self.req_to_blocks.get(request.req_handle, ())) + len(new_computed_blocks)
        num_new_blocks = max(0, -(-num_tokens // self.block_size) - num_held)
        return num_new_blocks + sum(1 for block in new_computed_blocks if block.ref_cnt == 0)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that became full (all tokens computed)."""
        if not self.enable_caching:
            return
        handle = request.req_handle
        num_full_blocks = min(num_computed_tokens // self.block_size, len(request.block_hashes))
        num_cached_blocks = self.num_cached_blocks.get(handle, 0)
        if num_full_blocks <= num_cached_blocks:
            return
        self.block_pool.cache_full_blocks(
            request,
            self.req_to_blocks[handle],
            request.block_hashes,
            num_cached_blocks,
            num_full_blocks,
        )
        self.num_cached_blocks[handle] = num_full_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its least shareable blocks (the
        longest prefixes) are evicted before the shared head of the sequence."""
        blocks = self.req_to_blocks.pop(request.req_handle, None)
        self.num_cached_blocks.pop(request.req_handle, None)
        if self.state_slots is not None:
            self.state_slots.free(request.req_handle)
        if blocks:
            null_block = self.block_pool.null_block
            self.block_pool.free_blocks(b for b in reversed(blocks) if b is not null_block)

    def get_blocks(self, request: Request) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request.req_handle, [])

    def get_block_ids(self, request: Request) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request.req_handle, ())]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        return self.block_pool.reset_prefix_cache()

    def reset(self, num_blocks: int) -> None:
        """A fresh cache of `num_blocks` blocks, all free, nothing cached (the ranks were brought
        up again: the KV they held is gone). Requires that no request holds blocks; the
        prefix-cache counters go on, and KV-event subscribers get an AllBlocksCleared."""
        if self.req_to_blocks:
            raise AssertionError(f"{len(self.req_to_blocks)} requests still hold KV blocks")
        self.kv_events.reset(num_blocks)
        self.block_pool = BlockPool(num_blocks, self.enable_caching, self.kv_events)
        self.num_cached_blocks.clear()
        if self.state_slots is not None:
            self.state_slots = StateSlotPool(self.num_state_slots)

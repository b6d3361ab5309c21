"""KV-cache events (vLLM's BlockStored / BlockRemoved / AllBlocksCleared) and the snapshot a new
subscriber starts from.

The block pool reports every block it caches, evicts or forgets to a `KVEventRecorder`. While
some frontend stream subscribes, the recorder keeps those changes as events, in order, one
`BlockStored` per run of consecutive blocks of a sequence cached together (columnar: the run's
hashes and token ids are slices of the request's own lists), and the busy loop hands them out
after each iteration. From the first subscription on, the recorder also keeps each cached
block's tokens (one preallocated array, a row per block id) and its parent's hash, so a
subscriber that arrives later, or one that fell behind, gets the whole cache as events
(`snapshot`): an `AllBlocksCleared`, then every cached block, parents first. Before any client
ever subscribed it does nothing.

Invariant: applying the events a subscriber got, in order, to an empty index gives exactly the
hashes of `BlockPool.cached_block_hash_to_block` as of the last iteration they cover, less the
blocks cached before the first subscription that were not evicted since.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from core_svc.kv_cache.block_hash import BlockHash
from core_svc.lora import LoraRequest
from core_svc.mm_inputs import MultiModalFeatureSpec

MAX_SNAPSHOT_BLOCKS_PER_BATCH = 2048
"""A snapshot goes out in batches of at most this many blocks (each a message under 1 MB)."""


@dataclass(frozen=True, slots=True)
class BlockExtraKeys:
    """One block's hash inputs beyond its tokens: the cache salt (a sequence's first block),
    the (identifier, offset from the block's first token) of overlapping images and the LoRA
    adapter's name (every block of an adapter's request)."""

    cache_salt: str = ""
    multimodal: tuple[tuple[str, int], ...] = ()
    lora_name: str = ""
    lora_id: int = 0


@dataclass(slots=True)
class BlockStored:
    """Blocks became cached: `block_hashes[i]` holds `token_ids[i * block_size:][:block_size]`;
    `parent_block_hash` is the hash of the block before the first (None: the first block of
    its sequence). `extra_keys` is None, or one entry per block."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    extra_keys: list[BlockExtraKeys] | None = None

    @property
    def lora_id(self) -> int:
        """The LoRA adapter the blocks were computed with (0: the base model; a run is one
        sequence's, so one adapter's)."""
        return self.extra_keys[0].lora_id if self.extra_keys else 0


@dataclass(slots=True)
class BlockRemoved:
    """Blocks left the cache (evicted to hold other tokens)."""

    block_hashes: list[BlockHash]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """No block is cached any more."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventBatch:
    """Events for one subscriber's stream that travel without step outputs: a snapshot's
    batches (`is_snapshot`), or live events of an iteration that sent the client no outputs."""

    events: list[KVCacheEvent]
    is_snapshot: bool = False


class CachedSequence(Protocol):
    """What the recorder reads of a request whose blocks are cached."""

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def cache_salt(self) -> str: ...

    @property
    def mm_features(self) -> tuple[MultiModalFeatureSpec, ...]: ...

    @property
    def lora(self) -> LoraRequest | None: ...


class CachedBlock(Protocol):
    @property
    def block_id(self) -> int: ...


class KVEventRecorder:
    """The prefix cache's changes as events while any client subscribes; and, from the first
    subscription on, what a snapshot needs of every block cached since (its tokens, parent and
    extra keys). Until a client first subscribes it does nothing at all, so an engine nobody
    asks for events pays nothing; blocks cached before then stay out of every snapshot (and
    their eviction is not announced) until they are evicted and cached again."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.subscribers: set[int] = set()
        """Client ids of the streams that get the events."""
        self.is_recording = False
        """Whether changes are kept as events (some client subscribes)."""
        self.keeps_blocks = False
        """Whether cached blocks' tokens are kept (set at the first subscription, then kept)."""
        self.events: list[KVCacheEvent] = []
        self._tokens = np.zeros((0, block_size), dtype=np.uint32)
        self._parents: list[BlockHash | None] = []
        self._extra_keys: list[BlockExtraKeys | None] = []
        self._is_known = bytearray()
        """Per block id: 1 when its tokens were kept when it was last cached."""

    def _allocate(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        if self.keeps_blocks:
            self._tokens = np.zeros((num_blocks, self.block_size), dtype=np.uint32)
            self._parents = [None] * num_blocks
            self._extra_keys = [None] * num_blocks
            self._is_known = bytearray(num_blocks)

    def reset(self, num_blocks: int) -> None:
        """A fresh cache of `num_blocks` blocks replaced the old one (recovery)."""
        self._allocate(num_blocks)
        self.cleared()

    def subscribe(
        self, client_id: int, cached: Mapping[BlockHash, CachedBlock]
    ) -> list[KVEventBatch]:
        """Start (or restart: a resync) the client's events; returns its snapshot of `cached`.
        The caller hands the events recorded so far to the other subscribers first."""
        if not self.keeps_blocks:
            self.keeps_blocks = True
            self._allocate(self.num_blocks)
        self.subscribers.add(client_id)
        self.is_recording = True
        return self.snapshot(cached)

    def unsubscribe(self, client_id: int) -> None:
        self.subscribers.discard(client_id)
        if not self.subscribers:
            self.is_recording = False
            self.events = []

    def take(self) -> list[KVCacheEvent]:
        """The events recorded since the last call (empty when nothing happened)."""
        events = self.events
        if events:
            self.events = []
        return events

    def stored(
        self,
        sequence: CachedSequence,
        blocks: Sequence[CachedBlock],
        block_hashes: Sequence[BlockHash],
        start: int,
        end: int,
    ) -> None:
        """blocks[start:end], blocks start..end-1 of the sequence, were just cached."""
        if not self.keeps_blocks:
            return
        size = self.block_size
        token_ids = sequence.all_token_ids[start * size : end * size]
        extra_keys = None
        lora = sequence.lora
        if sequence.mm_features or (start == 0 and sequence.cache_salt) or lora is not None:
            extra_keys = _extra_keys(sequence, start, end, size)
        parents, extras, known = self._parents, self._extra_keys, self._is_known
        if end - start == 1:  # the common case: a decode fills one block at a time
            block_id = blocks[start].block_id
            self._tokens[block_id] = token_ids
            parents[block_id] = block_hashes[start - 1] if start else None
            extras[block_id] = extra_keys[0] if extra_keys is not None else None
            known[block_id] = 1
        else:
            block_ids = [block.block_id for block in blocks[start:end]]
            rows = np.frombuffer(array("I", token_ids), dtype=np.uint32).reshape(-1, size)
            self._tokens[block_ids] = rows
            parents[block_ids[0]] = block_hashes[start - 1] if start else None
            for block_id, parent_hash in zip(
                block_ids[1:], block_hashes[start : end - 1], strict=True
            ):
                parents[block_id] = parent_hash
            for i, block_id in enumerate(block_ids):
                extras[block_id] = extra_keys[i] if extra_keys is not None else None
                known[block_id] = 1
        if self.is_recording:
            first_parent = block_hashes[start - 1] if start else None
            hashes = list(block_hashes[start:end])
            self.events.append(BlockStored(hashes, first_parent, token_ids, extra_keys))

    def removed(self, block_id: int, block_hash: BlockHash) -> None:
        """A cached block was evicted (call only while `is_recording`); not announced when it
        was cached before the first subscription (no subscriber knows it)."""
        if not self._is_known[block_id]:
            return
        events = self.events
        if events and isinstance(last := events[-1], BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            events.append(BlockRemoved([block_hash]))

    def cleared(self) -> None:
        """Every cached hash was forgotten."""
        if self.is_recording:
            self.events.append(AllBlocksCleared())

    def snapshot(self, cached: Mapping[BlockHash, CachedBlock]) -> list[KVEventBatch]:
        """The whole cache as events: AllBlocksCleared, then the cached blocks as chains,
        every parent that is cached before its children, in batches."""
        runs: list[BlockStored] = []
        known = self._is_known
        for block_hash, block in _parents_first(cached, self._parents):
            if known[block.block_id]:
                self._append_to_runs(runs, block_hash, block.block_id)
        batches = [KVEventBatch([AllBlocksCleared()], is_snapshot=True)]
        num_blocks = 0
        for run in runs:
            if num_blocks + len(run.block_hashes) > MAX_SNAPSHOT_BLOCKS_PER_BATCH:
                batches.append(KVEventBatch([], is_snapshot=True))
                num_blocks = 0
            batches[-1].events.append(run)
            num_blocks += len(run.block_hashes)
        return batches

    def _append_to_runs(
        self, runs: list[BlockStored], block_hash: BlockHash, block_id: int
    ) -> None:
        parent, extra = self._parents[block_id], self._extra_keys[block_id]
        tokens = self._tokens[block_id].tolist()
        last = runs[-1] if runs else None
        if (
            last is not None
            and last.block_hashes[-1] == parent
            and len(last.block_hashes) < MAX_SNAPSHOT_BLOCKS_PER_BATCH
            and (last.extra_keys is None) == (extra is None)
        ):
            last.block_hashes.append(block_hash)
            last.token_ids.extend(tokens)
            if last.extra_keys is not None and extra is not None:
                last.extra_keys.append(extra)
            return
        runs.append(BlockStored([block_hash], parent, tokens, None if extra is None else [extra]))


def _parents_first(
    cached: Mapping[BlockHash, CachedBlock], parents: list[BlockHash | None]
) -> Iterable[tuple[BlockHash, CachedBlock]]:
    """The cached blocks, each after its cached ancestors (depth first, so chains stay
    together)."""
    emitted: set[BlockHash] = set()
    for block_hash, block in cached.items():
        if block_hash in emitted:
            continue
        chain = [(block_hash, block)]
        parent = parents[block.block_id]
        while parent is not None and parent not in emitted:
            parent_block = cached.get(parent)
            if parent_block is None:
                break
            chain.append((parent, parent_block))
            parent = parents[parent_block.block_id]
        for item in reversed(chain):
            emitted.add(item[0])
            yield item


def _extra_keys(
    sequence: CachedSequence, start: int, end: int, block_size: int
) -> list[BlockExtraKeys]:
    """Per block of [start, end), what besides tokens went into its hash (block_hash.py's
    salt and multimodal keys)."""
    salt = sequence.cache_salt if start == 0 else ""
    features = sequence.mm_features
    lora = sequence.lora
    lora_name, lora_id = ("", 0) if lora is None else (lora.name, lora.lora_id)
    keys = []
    for i in range(start, end):
        first, last = i * block_size, (i + 1) * block_size
        multimodal = tuple(
            (f.identifier, f.offset - first) for f in features if f.offset < last and f.end > first
        )
        keys.append(BlockExtraKeys(salt if i == 0 else "", multimodal, lora_name, lora_id))
    return keys

"""The engine's KV-cache events as this frontend serves them (vLLM's BlockStored / BlockRemoved /
AllBlocksCleared), and the mirror of the engine's prefix cache they keep.

The core sends the events of every step on this frontend's stream (after a snapshot of the
whole cache when the stream opens). `KvEventHub.apply` keeps a mirror of the cached blocks
(hash -> parent, token ids, extra keys) and hands each batch to every subscriber: the gateway
streams of SubscribeKvEvents and the ZMQ publisher. A subscriber that falls behind loses its
pending batches and starts again from the mirror (an AllBlocksCleared, then every block):
nothing on this path ever waits for a slow consumer.

Block hashes here are vLLM's external block hashes: the low 64 bits of the engine's SHA-256
prefix-cache hash, as an unsigned integer (vLLM's `maybe_convert_block_hash`).
"""

from __future__ import annotations

import asyncio
import logging
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

logger = logging.getLogger(__name__)

MAX_SNAPSHOT_BLOCKS_PER_BATCH = 2048
DEFAULT_MAX_PENDING_BATCHES = 1024
"""Batches a subscriber may leave unsent before it is resynced."""
MAX_SUBSCRIBERS = 64
"""Gateway streams one frontend serves at once (each costs a queue and a snapshot)."""


class TooManySubscribers(Exception):
    """MAX_SUBSCRIBERS streams are open already."""


@dataclass(frozen=True, slots=True)
class BlockExtraKeys:
    """One block's hash inputs beyond its tokens: the cache salt (a sequence's first block),
    (identifier, offset from the block's first token) of each overlapping image, and the LoRA
    adapter it was computed with (name and the engine's id; every block of its requests)."""

    cache_salt: str = ""
    multimodal: tuple[tuple[str, int], ...] = ()
    lora_name: str = ""
    lora_id: int = 0


@dataclass(slots=True)
class BlocksStored:
    """A run of blocks became cached: block_hashes[i] holds token_ids[i * block_size:][:block_size];
    parent_block_hash is None when the first block starts its sequence."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    extra_keys: list[BlockExtraKeys] | None = None


@dataclass(slots=True)
class BlocksRemoved:
    block_hashes: list[int]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlocksStored | BlocksRemoved | AllBlocksCleared


@dataclass(slots=True)
class KvEvents:
    """One message's worth of events from the core, in order (a CoreEvent)."""

    events: list[KvEvent]


@dataclass(slots=True)
class MirrorBlock:
    parent: int | None
    token_ids: array[int]
    extra_keys: BlockExtraKeys | None


RESYNC = object()
"""Queued for a subscriber that fell behind: send the mirror again before anything else."""


@dataclass(eq=False)
class KvSubscriber:
    """One consumer's bounded queue: each item is a group of batches to send in order (one
    batch from the core, or a snapshot), or RESYNC."""

    max_pending: int
    queue: asyncio.Queue[list[list[KvEvent]] | object] = field(default_factory=asyncio.Queue)
    is_lagging: bool = False
    num_resyncs: int = 0

    def offer(self, events: list[KvEvent]) -> None:
        if self.is_lagging:
            return
        if self.queue.qsize() >= self.max_pending:
            while not self.queue.empty():
                self.queue.get_nowait()
            self.is_lagging = True
            self.num_resyncs += 1
            self.queue.put_nowait(RESYNC)
            return
        self.queue.put_nowait([events])


class KvEventSink(Protocol):
    """A consumer fed synchronously, e.g. the ZMQ publisher's queue."""

    def offer(self, events: list[KvEvent]) -> bool:
        """Take a batch; False when full (the hub then calls `resync`)."""
        ...

    def resync(self, batches: list[list[KvEvent]]) -> None:
        """Drop what is pending and take the whole cache instead."""
        ...


class KvEventHub:
    """The mirror of the engine's prefix cache and the consumers fed from it: `sinks` given
    at construction, subscribers (gateway streams) as they come and go."""

    def __init__(
        self,
        block_size: int,
        sinks: Sequence[KvEventSink] = (),
        max_pending_batches: int = DEFAULT_MAX_PENDING_BATCHES,
    ) -> None:
        self.block_size = block_size
        self.sinks = tuple(sinks)
        self.max_pending_batches = max_pending_batches
        self.blocks: dict[int, MirrorBlock] = {}
        self._subscribers: set[KvSubscriber] = set()
        self.num_batches = 0
        """Batches applied since the frontend started."""

    def apply(self, events: list[KvEvent]) -> None:
        """One batch from the core: update the mirror, then offer it to every subscriber."""
        blocks, size = self.blocks, self.block_size
        for event in events:
            if isinstance(event, BlocksStored):
                parent = event.parent_block_hash
                for i, block_hash in enumerate(event.block_hashes):
                    tokens = array("I", event.token_ids[i * size : (i + 1) * size])
                    extra = event.extra_keys[i] if event.extra_keys else None
                    blocks[block_hash] = MirrorBlock(parent, tokens, extra)
                    parent = block_hash
            elif isinstance(event, BlocksRemoved):
                for block_hash in event.block_hashes:
                    blocks.pop(block_hash, None)
            else:
                blocks.clear()
        self.num_batches += 1
        for subscriber in self._subscribers:
            subscriber.offer(events)
        for sink in self.sinks:
            if not sink.offer(events):
                sink.resync(self.snapshot())

    def clear(self) -> None:
        """The engine's cache is gone or unknown (the stream to the core broke)."""
        if self.blocks or self.num_batches:
            self.apply([AllBlocksCleared()])

    def subscribe(self, max_pending: int | None = None) -> KvSubscriber:
        """A new consumer; its first batches are the mirror (`snapshot`) as it is now. Raises
        TooManySubscribers past MAX_SUBSCRIBERS."""
        if len(self._subscribers) >= MAX_SUBSCRIBERS:
            raise TooManySubscribers(f"{MAX_SUBSCRIBERS} KV-event streams are open already")
        subscriber = KvSubscriber(max_pending or self.max_pending_batches)
        subscriber.queue.put_nowait(self.snapshot())
        self._subscribers.add(subscriber)
        return subscriber

    def unsubscribe(self, subscriber: KvSubscriber) -> None:
        self._subscribers.discard(subscriber)

    async def next_batches(self, subscriber: KvSubscriber) -> list[list[KvEvent]]:
        """The subscriber's next batches to send: one batch from the core, or the mirror in
        batches (its first, or again after it fell behind)."""
        item = await subscriber.queue.get()
        if item is RESYNC:
            subscriber.is_lagging = False
            logger.warning("a KV-event subscriber fell behind; sending it the whole cache again")
            return self.snapshot()
        assert isinstance(item, list)
        return item

    def snapshot(self) -> list[list[KvEvent]]:
        """AllBlocksCleared, then every mirrored block (parents first), in batches."""
        batches: list[list[KvEvent]] = [[AllBlocksCleared()]]
        run: BlocksStored | None = None
        num_blocks = 0
        for block_hash, block in self._parents_first():
            if num_blocks >= MAX_SNAPSHOT_BLOCKS_PER_BATCH:
                batches.append([])
                num_blocks, run = 0, None
            same_run = run is not None and run.block_hashes[-1] == block.parent
            if (
                run is None
                or not same_run
                or (run.extra_keys is None) != (block.extra_keys is None)
            ):
                run = BlocksStored([], block.parent, [], None if block.extra_keys is None else [])
                batches[-1].append(run)
            run.block_hashes.append(block_hash)
            run.token_ids.extend(block.token_ids)
            if run.extra_keys is not None and block.extra_keys is not None:
                run.extra_keys.append(block.extra_keys)
            num_blocks += 1
        return batches

    def _parents_first(self) -> Iterator[tuple[int, MirrorBlock]]:
        blocks = self.blocks
        emitted: set[int] = set()
        for block_hash, block in blocks.items():
            if block_hash in emitted:
                continue
            chain = [(block_hash, block)]
            parent = block.parent
            while parent is not None and parent not in emitted and parent in blocks:
                chain.append((parent, blocks[parent]))
                parent = blocks[parent].parent
            for item in reversed(chain):
                emitted.add(item[0])
                yield item

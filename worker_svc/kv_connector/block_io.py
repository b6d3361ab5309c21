"""Raw-byte access to a rank's cache blocks, for the transfer's two ends.

A layer's cache is one tensor with (key, value) in dimension 0 and the block in dimension 1
(worker_svc/runner/kv_cache.py), so `layer[:, ids]` is the K and V planes of those blocks; a
chunk is those bytes for one layer and a run of blocks, contiguous. CPU caches are read and
written through numpy views (no torch thread team is started off the step thread: a second live
OpenMP team halves the step's throughput); CUDA caches through torch on the cache's device.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from worker_svc.runner.kv_cache import PagedKVCache


@dataclass(frozen=True, slots=True)
class Chunk:
    """Blocks [first_block, first_block + num_blocks) of a transfer's list, of one layer."""

    layer: int
    first_block: int
    num_blocks: int
    data: bytes


class BlockIO:
    """Reads and writes whole blocks of `cache`, layer by layer, as bytes."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.num_blocks = cache.num_blocks
        self.layers = [layer.view(torch.uint8) for layer in cache.layers]
        self.is_cpu = all(layer.device.type == "cpu" for layer in self.layers)
        self._arrays = [layer.numpy() for layer in self.layers] if self.is_cpu else []
        self.block_shape: tuple[int, ...] = tuple(self.layers[0].shape[2:]) if self.layers else ()
        self.num_halves = int(self.layers[0].shape[0]) if self.layers else 2
        """Keys and values (2), or a latent cache's keys only (1)."""
        self.block_bytes = self.num_halves * int(np.prod(self.block_shape)) if self.layers else 0
        """Bytes of one block of one layer (K and V, or the latent)."""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def id_problem(self, block_ids: Sequence[int]) -> str | None:
        """Why `block_ids` cannot be read or written here (0 is the null block), or None."""
        bad = [i for i in block_ids if not 0 < i < self.num_blocks]
        if bad:
            return f"block ids {bad[:4]} outside 1..{self.num_blocks - 1}"
        return None

    def chunk_ranges(
        self, block_ids: Sequence[int], blocks_per_chunk: int
    ) -> Iterator[tuple[int, int, Sequence[int]]]:
        """(layer, first block's index, block ids) per chunk, layer by layer, `blocks_per_chunk`
        blocks a chunk."""
        for layer in range(self.num_layers):
            for first in range(0, len(block_ids), blocks_per_chunk):
                yield layer, first, block_ids[first : first + blocks_per_chunk]

    def chunks(self, block_ids: Sequence[int], blocks_per_chunk: int) -> Iterator[Chunk]:
        """The blocks' bytes, chunk by chunk (chunk_ranges), read lazily."""
        for layer, first, ids in self.chunk_ranges(block_ids, blocks_per_chunk):
            yield Chunk(layer, first, len(ids), self.read(layer, ids))

    def read(self, layer: int, block_ids: Sequence[int]) -> bytes:
        if self.is_cpu:
            run = _as_run(block_ids)  # a fresh prompt's blocks are mostly one run: one copy
            return self._arrays[layer][:, run if run is not None else list(block_ids)].tobytes()
        raw = self.layers[layer]
        index = torch.tensor(list(block_ids), dtype=torch.int64, device=raw.device)
        return raw.index_select(1, index).cpu().numpy().tobytes()

    def read_into(self, layer: int, block_ids: Sequence[int], out: memoryview) -> None:
        """Copy the blocks' bytes (as `read` gives them) into `out`, exactly their size."""
        target = np.frombuffer(out, dtype=np.uint8).reshape(
            self.num_halves, len(block_ids), *self.block_shape
        )
        if self.is_cpu:
            run = _as_run(block_ids)
            target[...] = self._arrays[layer][:, run if run is not None else list(block_ids)]
            return
        target[...] = np.frombuffer(self.read(layer, block_ids), dtype=np.uint8).reshape(
            target.shape
        )

    def write(self, layer: int, block_ids: Sequence[int], data: bytes | memoryview) -> None:
        """Write `data` (len(block_ids) blocks of `layer`, as `read` gives them) at `block_ids`;
        the caller checked the ids and the size."""
        source = np.frombuffer(data, dtype=np.uint8).reshape(
            self.num_halves, len(block_ids), *self.block_shape
        )
        if self.is_cpu:
            run = _as_run(block_ids)
            self._arrays[layer][:, run if run is not None else list(block_ids)] = source
            return
        raw = self.layers[layer]
        index = torch.tensor(list(block_ids), dtype=torch.int64, device=raw.device)
        raw.index_copy_(1, index, torch.from_numpy(source.copy()).to(raw.device))

    def synchronize(self) -> None:
        """Wait until the writes issued so far landed (CUDA copies run on the device's stream)."""
        if not self.is_cpu and self.layers:
            torch.cuda.synchronize(self.layers[0].device)


def _as_run(block_ids: Sequence[int]) -> slice | None:
    """`block_ids` as a slice when they are consecutive ascending ids (a view, not a gather)."""
    if not block_ids:
        return None
    first, last = block_ids[0], block_ids[-1]
    if last - first + 1 != len(block_ids) or any(b != first + i for i, b in enumerate(block_ids)):
        return None
    return slice(first, last + 1)

"""The paged KV cache of one rank: one tensor per decoder layer of its pipeline stage.

Each layer's tensor has the attention backend's layout with (key, value) in dimension 0 and
the block index in dimension 1. Block 0 is the null block: the engine core reserves it and never
hands it to a request (core_svc.kv_cache.block_pool), so it is zeroed once and padded block-table
entries point at it. Blocks the engine core
assigns afresh are zeroed before use too, so a backend that reads whole blocks (the torch
reference) never meets uninitialised memory (which could hold NaN bit patterns); the rest of
the cache is allocated with `torch.empty`, i.e. lazily on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from worker_svc.attention.backend import AttentionBackend
from worker_svc.attention.kv_quant import is_fp8


@dataclass(frozen=True, slots=True)
class KvCacheSpec:
    """Per-rank shape of the cache: this stage's layers and this TP rank's KV heads; `dtype`
    is the cache's (the compute dtype, or fp8: one byte per value, so twice the blocks fit);
    `num_halves` 2 for keys and values, 1 for a latent cache (MLA: keys only, the latent and
    its rope part per token, not per head)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    num_halves: int = 2

    def bytes_per_block(self, block_size: int) -> int:
        element_size = torch.empty(0, dtype=self.dtype).element_size()
        per_layer = self.num_halves * block_size * self.num_kv_heads * self.head_dim
        return self.num_layers * per_layer * element_size


@dataclass(frozen=True, slots=True)
class KvCapacity:
    """How many blocks fit: available_bytes // bytes_per_block, after the state slots (a model
    with state layers: `num_state_slots` of `bytes_per_state_slot`, reserved first)."""

    available_bytes: int
    bytes_per_block: int
    num_blocks: int
    num_state_slots: int = 0
    bytes_per_state_slot: int = 0


def kv_capacity(spec: KvCacheSpec, block_size: int, available_bytes: int) -> KvCapacity:
    """Capacity of `available_bytes`; the null block (block 0) is one of the blocks counted."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    per_block = spec.bytes_per_block(block_size)
    available_bytes = max(0, available_bytes)
    return KvCapacity(available_bytes, per_block, available_bytes // per_block)


def reserve_state_slots(
    capacity: KvCapacity,
    spec: KvCacheSpec,
    block_size: int,
    num_state_slots: int,
    bytes_per_state_slot: int,
) -> KvCapacity:
    """`capacity` with `num_state_slots` state slots taken out of its bytes first (a model with
    state layers), the blocks counted in what is left."""
    state_bytes = num_state_slots * bytes_per_state_slot
    left = kv_capacity(spec, block_size, capacity.available_bytes - state_bytes)
    return KvCapacity(
        capacity.available_bytes,
        left.bytes_per_block,
        left.num_blocks,
        num_state_slots,
        bytes_per_state_slot,
    )


NULL_BLOCK_ID = 0


class PagedKVCache:
    """Per-layer KV tensors of `num_blocks` blocks of `block_size` tokens; block 0 is the null
    block. Dimension 0 holds keys and values (one of them for a latent cache)."""

    def __init__(
        self,
        backend: AttentionBackend,
        spec: KvCacheSpec,
        num_blocks: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}"
            )
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.null_block_id = NULL_BLOCK_ID
        shape = backend.kv_cache_shape(num_blocks, block_size)
        self.layers = [
            torch.empty(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)
        ]
        self.zero_blocks(np.array([self.null_block_id]))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)

    def zero_blocks(self, block_ids: npt.NDArray[np.int64]) -> None:
        if not len(block_ids):
            return
        if int(block_ids.max()) >= self.num_blocks or int(block_ids.min()) < 0:
            raise ValueError(f"block id outside 0..{self.num_blocks - 1}")
        if not self.layers:  # an encoder-only model's: blocks without KV
            return
        index = torch.from_numpy(block_ids).to(self.layers[0].device)
        for layer in self.layers:
            # Zero bits are 0.0 in every float format; fp8 tensors are filled as bytes.
            target = layer.view(torch.uint8) if is_fp8(layer.dtype) else layer
            target.index_fill_(1, index, 0)

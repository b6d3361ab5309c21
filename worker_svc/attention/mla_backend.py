"""Paged attention over a latent KV cache (multi-head latent attention, DeepSeek-V2/V3), in
plain torch: vLLM's MLA backends' arithmetic, on the torch backend's indexing.

A latent cache stores per token one row, not per head and not K and V apart: the normalised
KV latent (kv_lora_rank values) followed by its rotated rope part (qk_rope_head_dim), so a
block of 16 tokens of DeepSeek-V3 is 16 x 576 values per layer where its 128 heads would cache
16 x 128 x 2 x 192 as keys and values. The model attends in that latent space (the "absorbed"
form): its queries are each head's nope part times the head's key up-projection, followed by
the rotated rope part, so every head attends to the same one "KV head" (MQA), and the value of
a token is its latent (the first `value_dim` of its key); the model up-projects each head's
latent output to its values afterwards. Cache layout per layer: [1, num_blocks, 1, block_size,
head_dim], dimension 0 holding the keys alone.

It attends in float32 (queries, keys and values as the model passes them; the cache keeps the
compute dtype and its gathers are widened): torch's CPU batched matmuls of these shapes run
5-40x slower in bfloat16 than in float32 here (12 heads of 272 over one KV head: 5.3 vs 1.0 ms
for the scores of 32 decodes), so float32 is both the faster and the more exact choice.
"""

from __future__ import annotations

from typing import Any

import torch

from worker_svc.attention.torch_backend import TorchAttentionBackend


class MlaAttentionBackend(TorchAttentionBackend):
    """The torch backend over a latent cache: keys written and gathered, values their first
    `value_dim` columns (views, no copy); float32 attention."""

    name = "torch_mla"
    caches_latent_values = True
    supports_fp8_kv_cache = False
    supports_sinks = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """TorchAttentionBackend's arguments; it computes in float32 whatever the model's
        dtype (its cache keeps the model's: `kv_cache_dtype`)."""
        super().__init__(*args, **kwargs)
        self.dtype = torch.float32

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (1, num_blocks, self.num_kv_heads, block_size, self.head_dim)

    def write_kv_rows(
        self,
        kv_cache: torch.Tensor,
        write_index: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> None:
        """Store the step's keys (their values are part of them), in the cache's dtype."""
        rows = key.reshape(-1, self.head_dim).to(kv_cache.dtype)
        kv_cache.view(-1, self.head_dim).index_copy_(0, write_index, rows)

    def _gather(
        self, kv_cache: torch.Tensor, gather_index: torch.Tensor, num_rows: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        block_rows = kv_cache.shape[1] * kv_cache.shape[2]
        rows = kv_cache[0].view(block_rows, kv_cache.shape[3] * self.head_dim)
        key = rows.index_select(0, gather_index).view(num_rows, -1, self.head_dim).float()
        return key, key[..., : self.value_dim]

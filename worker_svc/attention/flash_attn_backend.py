"""Paged attention through the stock flash-attn package (CUDA, fp16/bf16).

Cache layout per layer: [2, num_blocks, block_size, kv_heads, head_dim], which is what
flash-attn's paged API reads. Decode-only steps call `flash_attn_with_kvcache(...,
block_table=...)`; steps with a prefill chunk call `flash_attn_varlen_func(...,
block_table=...)`, whose causal mask is aligned bottom-right, so chunks with prior context
work. A sliding window w is flash-attn's `window_size=(w - 1, 0)` and a soft cap its `softcap`
(flash-attn >= 2.6). Stock flash-attn requires the page (block) size to be a multiple of 256 (vLLM's own
fork lifts this to 16); the backend refuses other block sizes rather than read garbage.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker_svc.attention.backend import AttentionBackend, AttentionInputs, is_importable

FLASH_ATTN_BLOCK_MULTIPLE = 256


@dataclass(frozen=True, slots=True)
class FlashAttnMetadata:
    """Per-step device indices in the int32 form flash-attn takes."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    cu_seqlens_q: torch.Tensor  # int32 [num_reqs + 1]
    cu_seqlens_k: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_tables: torch.Tensor  # int32 [num_reqs, max_blocks]
    max_query_len: int
    max_seq_len: int


class FlashAttnBackend(AttentionBackend):
    """flash-attn 2.x paged KV; chosen by "auto" on CUDA when it imports and the block size fits."""

    name = "flash_attn"

    @classmethod
    def unsupported_reason(
        cls, device: torch.device, block_size: int | None, dtype: torch.dtype | None = None
    ) -> str | None:
        if not is_importable("flash_attn"):
            return "flash_attn is not installed"
        if device.type != "cuda":
            return "flash_attn needs a CUDA device"
        if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
            return f"flash_attn supports float16 and bfloat16, not {dtype}"
        if block_size is not None and block_size % FLASH_ATTN_BLOCK_MULTIPLE:
            return (
                f"stock flash-attn's paged KV cache needs block_size to be a multiple of "
                f"{FLASH_ATTN_BLOCK_MULTIPLE}, got {block_size}"
            )
        return None

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def _int32(self, array: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int32))
        return host.to(self.device, non_blocking=True)

    def build_metadata(self, inputs: AttentionInputs) -> FlashAttnMetadata:
        num_blocks = -(-inputs.max_seq_len // inputs.block_size)
        cu_seqlens_k = np.concatenate([[0], np.cumsum(inputs.seq_lens)])
        slots = torch.from_numpy(np.ascontiguousarray(inputs.slot_mapping))
        return FlashAttnMetadata(
            slot_mapping=slots.to(self.device, non_blocking=True),
            cu_seqlens_q=self._int32(inputs.query_start_loc),
            cu_seqlens_k=self._int32(cu_seqlens_k),
            seq_lens=self._int32(inputs.seq_lens),
            block_tables=self._int32(inputs.block_tables[:, :num_blocks]),
            max_query_len=inputs.max_query_len,
            max_seq_len=inputs.max_seq_len,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: object,
    ) -> torch.Tensor:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        assert isinstance(metadata, FlashAttnMetadata)
        window = self.options.sliding_window
        extra = {
            "window_size": (-1, -1) if window is None else (window - 1, 0),
            "softcap": self.options.logits_soft_cap or 0.0,
        }
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        per_slot = (-1, self.num_kv_heads, self.head_dim)  # slot = block * block_size + offset
        k_cache.view(per_slot).index_copy_(0, metadata.slot_mapping, key)
        v_cache.view(per_slot).index_copy_(0, metadata.slot_mapping, value)
        if metadata.max_query_len == 1:
            out = flash_attn_with_kvcache(
                query.unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=metadata.seq_lens,
                block_table=metadata.block_tables,
                softmax_scale=self.scale,
                causal=True,
                **extra,
            )
            return out.squeeze(1)  # type: ignore[no-any-return, unused-ignore]
        return flash_attn_varlen_func(  # type: ignore[no-any-return, unused-ignore]
            query,
            k_cache,
            v_cache,
            cu_seqlens_q=metadata.cu_seqlens_q,
            cu_seqlens_k=metadata.cu_seqlens_k,
            max_seqlen_q=metadata.max_query_len,
            max_seqlen_k=metadata.max_seq_len,
            softmax_scale=self.scale,
            causal=True,
            block_table=metadata.block_tables,
            **extra,
        )

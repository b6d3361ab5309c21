"""Paged attention with our own Triton kernel (`triton_kernels.py`); CUDA, or CPU when interpreted.

The cache layout and the KV write are the torch backend's (head-major blocks, written with
`index_copy_` at precomputed rows); the kernel reads keys and values in place through the
block tables, so nothing is gathered.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from worker_svc.attention.backend import AttentionBackend, AttentionInputs, is_importable
from worker_svc.attention.torch_backend import head_major_write_index

BLOCK_M = 16
BLOCK_N = 32


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True, slots=True)
class TritonAttentionMetadata:
    """Per-step cache rows to write and the kernel's int32 index tensors."""

    write_index: torch.Tensor
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_tables: torch.Tensor  # int32 [num_reqs, max_blocks]
    max_query_len: int


class TritonAttentionBackend(AttentionBackend):
    """One kernel launch per layer covers every request of the step."""

    name = "triton"

    @classmethod
    def unsupported_reason(
        cls, device: torch.device, block_size: int | None, dtype: torch.dtype | None = None
    ) -> str | None:
        if not is_importable("triton"):
            return "triton is not installed (pip install triton)"
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return "the Triton kernel needs a CUDA device (or TRITON_INTERPRET=1 on CPU)"
        return None

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, self.num_kv_heads, block_size, self.head_dim)

    def _int32(self, array: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int32))
        return host.to(self.device, non_blocking=True)

    def build_metadata(self, inputs: AttentionInputs) -> TritonAttentionMetadata:
        write = head_major_write_index(inputs.slot_mapping, inputs.block_size, self.num_kv_heads)
        num_blocks = -(-inputs.max_seq_len // inputs.block_size)
        return TritonAttentionMetadata(
            write_index=torch.from_numpy(write).to(self.device, non_blocking=True),
            query_start_loc=self._int32(inputs.query_start_loc),
            seq_lens=self._int32(inputs.seq_lens),
            block_tables=self._int32(inputs.block_tables[:, :num_blocks]),
            max_query_len=inputs.max_query_len,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: object,
    ) -> torch.Tensor:
        from worker_svc.attention.triton_kernels import paged_attention_kernel

        assert isinstance(metadata, TritonAttentionMetadata)
        self.write_kv_rows(kv_cache, metadata.write_index, key, value)
        out = torch.empty_like(query)
        group = self.num_queries_per_kv
        block_m = max(BLOCK_M, _next_power_of_2(group))
        block_q = block_m // group
        num_reqs = metadata.seq_lens.shape[0]
        grid = (num_reqs, -(-metadata.max_query_len // block_q), self.num_kv_heads)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        paged_attention_kernel[grid](
            out,
            query,
            k_cache,
            v_cache,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            self.scale,
            self.options.sliding_window or 0,
            self.options.logits_soft_cap or 0.0,
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            metadata.block_tables.stride(0),
            QUERIES_PER_KV=group,
            CACHE_BLOCK_SIZE=kv_cache.shape[3],
            HEAD_DIM=self.head_dim,
            BLOCK_D=_next_power_of_2(self.head_dim),
            BLOCK_M=block_m,
            BLOCK_Q=block_q,
            BLOCK_N=BLOCK_N,
            DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
            IS_SLIDING=self.options.sliding_window is not None,
            IS_SOFT_CAPPED=self.options.logits_soft_cap is not None,
        )
        return out

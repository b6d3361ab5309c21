"""Our Triton paged-attention kernel: prefill chunks (with prior context) and decodes in one launch.

Grid: (request, query tile, KV head). One program attends BLOCK_Q query tokens of one request
for all `QUERIES_PER_KV` query heads that share one KV head, so each key/value tile is loaded
once per group: row r of the [BLOCK_M, head_dim] query tile is token r // QUERIES_PER_KV,
head r % QUERIES_PER_KV. Keys are read through the request's block table from a
[num_blocks, kv_heads, block_size, head_dim] cache with an online (flash) softmax. Query
token i of a request sits at position seq_len - query_len + i and sees keys <= that position;
with a sliding window w (> 0) only keys > position - w, and the loop starts at the tile's first
visible key, so blocks out of every query's window are never read. A soft cap c (> 0) turns
scores into c * tanh(scores / c) before the mask.

Runs on CUDA, and on CPU tensors under TRITON_INTERPRET=1 (how the tests check it).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit  # type: ignore[untyped-decorator, unused-ignore]
def paged_attention_kernel(  # type: ignore[no-untyped-def]
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale,
    sliding_window,
    soft_cap,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_c_block,
    stride_c_head,
    stride_c_pos,
    stride_bt_req,
    QUERIES_PER_KV: tl.constexpr,
    CACHE_BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    IS_SLIDING: tl.constexpr,
    IS_SOFT_CAPPED: tl.constexpr,
):
    req = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    num_context = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + rows // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_ok = (rows < BLOCK_Q * QUERIES_PER_KV) & (tok < q_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_off = (q_start + tok)[:, None] * stride_q_tok + head[:, None] * stride_q_head
    q = tl.load(q_ptr + q_off + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = num_context + tok

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    kv_end = tl.minimum(seq_len, num_context + (q_tile + 1) * BLOCK_Q)
    kv_start = 0
    if IS_SLIDING:
        kv_start = tl.maximum(0, num_context + q_tile * BLOCK_Q - sliding_window + 1)
    for start_n in range(kv_start, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_end
        block = tl.load(
            block_tables_ptr + req * stride_bt_req + offs_n // CACHE_BLOCK_SIZE, mask=n_ok, other=0
        )
        c_off = (
            block.to(tl.int64) * stride_c_block
            + kv_head * stride_c_head
            + (offs_n % CACHE_BLOCK_SIZE) * stride_c_pos
        )
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + c_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        if IS_SOFT_CAPPED:
            s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0))  # c tanh(s / c)
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        if IS_SLIDING:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + c_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # rows past the query: stored masked
    o_off = (q_start + tok)[:, None] * stride_o_tok + head[:, None] * stride_o_head
    tl.store(
        out_ptr + o_off + offs_d[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )

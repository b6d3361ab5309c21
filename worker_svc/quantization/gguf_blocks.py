"""GGUF's quantized blocks (llama.cpp's ggml formats) as `GroupQuantized` weights, exactly.

Each format's integers and scales map onto w = scale * q + offset per group without rounding:
every product and sum below is exact in float32 (a float16 d times an integer of at most 8
bits), so `GroupQuantized.dequantize()` equals `gguf.quants.dequantize` bit for bit (tested).

    Q8_0  32/block  w = d q                  int8 values, group 32, scale d (float16)
    Q4_0  32/block  w = d (q - 8)            4-bit q, scale d, offset -8 d (float16)
    Q4_1  32/block  w = d q + m              4-bit q, scale d, offset m (float16)
    Q5_0  32/block  w = d (q - 16)           int8 q - 16, scale d (float16)
    Q5_1  32/block  w = d q + m              int8 q (0..31), scale d, offset m (float16)
    Q4_K  256/block w = d sc_j q - dmin m_j  4-bit q, group 32, scale d sc_j, offset -dmin m_j
    Q5_K  256/block as Q4_K, 5-bit q         int8 q (0..31), group 32
    Q6_K  256/block w = d sc_j (q - 32)      int8 q - 32, group 16, scale d sc_j

The K-quants' two-level scales (a float16 per 256 times a 6- or 8-bit integer per 16/32) are
multiplied out into one float32 per group: exact, but 2 bits per weight of scales where the
file spends 0.5 (Q4_K: 6 bits a weight where the file has 4.5; Q6_K: 10 where it has 6.6).
Other types (F32/F16/BF16, Q2_K, Q3_K, IQ*) are not converted: their layers read float values.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from worker_svc.layers.quant_pack import GroupQuantized

QK_K = 256

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray | None, int, int]
"""(values [rows, K], scales [rows, groups], offsets or None, bits, group size)."""


def _f16(raw: np.ndarray) -> np.ndarray:
    """float16 fields (2 bytes each, last axis) as float32 [..., 1]."""
    return raw.copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32]: low nibbles first, then high (ggml's order in a block)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """[..., 4] bytes (little-endian 32 bits) -> the bit of each of the 32 values, [..., 32]."""
    bits = qh.copy().view("<u4")
    return ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def q8_0(blocks: np.ndarray) -> Arrays:
    d, qs = _f16(blocks[..., :2]), blocks[..., 2:].view(np.int8)
    return qs, d[..., 0], None, 8, 32


def q4_0(blocks: np.ndarray) -> Arrays:
    d = _f16(blocks[..., :2])[..., 0]
    return _nibbles(blocks[..., 2:]), d, -8 * d, 4, 32


def q4_1(blocks: np.ndarray) -> Arrays:
    d, m = _f16(blocks[..., :2])[..., 0], _f16(blocks[..., 2:4])[..., 0]
    return _nibbles(blocks[..., 4:]), d, m, 4, 32


def q5_0(blocks: np.ndarray) -> Arrays:
    d = _f16(blocks[..., :2])[..., 0]
    q = _nibbles(blocks[..., 6:]) | (_fifth_bits(blocks[..., 2:6]) << 4)
    return (q.astype(np.int16) - 16).astype(np.int8), d, None, 8, 32


def q5_1(blocks: np.ndarray) -> Arrays:
    d, m = _f16(blocks[..., :2])[..., 0], _f16(blocks[..., 2:4])[..., 0]
    q = _nibbles(blocks[..., 8:]) | (_fifth_bits(blocks[..., 4:8]) << 4)
    return q.astype(np.int8), d, m, 8, 32


def k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> the 8 six-bit scales and mins of a super-block."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mins.astype(np.float32)


def _k_header(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scales d sc_j, offsets -dmin m_j) [..., 8] of Q4_K/Q5_K super-blocks."""
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sc, mins = k_scales(blocks[..., 4:16])
    return d * sc, -(dmin * mins)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 128] -> [..., 256]: per 32 bytes, the 32 low nibbles then the 32 high ones."""
    pieces = qs.reshape(*qs.shape[:-1], 4, 32)
    return np.stack([pieces & 0x0F, pieces >> 4], axis=-2).reshape(*qs.shape[:-1], QK_K)


def q4_k(blocks: np.ndarray) -> Arrays:
    scales, offsets = _k_header(blocks)
    return _k_nibbles(blocks[..., 16:]), scales, offsets, 4, 32


def q5_k(blocks: np.ndarray) -> Arrays:
    scales, offsets = _k_header(blocks)
    qh = blocks[..., 16:48]
    high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [..., 8, 32]
    q = _k_nibbles(blocks[..., 48:]) | (high.reshape(*qh.shape[:-1], QK_K) << 4)
    return q.astype(np.int8), scales, offsets, 8, 32


def q6_k(blocks: np.ndarray) -> Arrays:
    ql, qh = blocks[..., 0:128], blocks[..., 128:192]
    sc = blocks[..., 192:208].view(np.int8).astype(np.float32)
    d = _f16(blocks[..., 208:210])
    low_shift = np.array([0, 4], np.uint8).reshape(2, 1)[None]
    low = (ql.reshape(*ql.shape[:-1], 2, 1, 64) >> low_shift) & 0x0F
    high_shift = np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    high = (qh.reshape(*qh.shape[:-1], 2, 1, 32) >> high_shift) & 0x03
    merged = low.reshape(*ql.shape[:-1], 8, 32) | (high.reshape(*qh.shape[:-1], 8, 32) << 4)
    q = merged.astype(np.int16) - 32
    return q.reshape(*ql.shape[:-1], QK_K).astype(np.int8), d * sc, None, 8, 16


CONVERTERS: dict[str, tuple[int, int, Callable[[np.ndarray], Arrays]]] = {
    "Q8_0": (32, 34, q8_0),
    "Q4_0": (32, 18, q4_0),
    "Q4_1": (32, 20, q4_1),
    "Q5_0": (32, 22, q5_0),
    "Q5_1": (32, 24, q5_1),
    "Q4_K": (QK_K, 144, q4_k),
    "Q5_K": (QK_K, 176, q5_k),
    "Q6_K": (QK_K, 210, q6_k),
}
"""ggml type name -> (weights per block, bytes per block, converter)."""


def is_convertible(type_name: str) -> bool:
    return type_name in CONVERTERS


def group_quantized(type_name: str, raw: np.ndarray, num_cols: int) -> GroupQuantized:
    """The weight [rows, num_cols] stored as ggml blocks `raw` (bytes [rows, row bytes])."""
    block_weights, block_bytes, convert = CONVERTERS[type_name]
    if num_cols % block_weights or raw.shape[-1] != num_cols // block_weights * block_bytes:
        raise ValueError(
            f"{type_name} rows of {num_cols} weights need {num_cols // block_weights} blocks of "
            f"{block_bytes} bytes, got {raw.shape[-1]} bytes"
        )
    rows = raw.reshape(raw.shape[0], num_cols // block_weights, block_bytes)
    values, scales, offsets, bits, group = convert(np.ascontiguousarray(rows))
    num_rows = raw.shape[0]
    return GroupQuantized(
        torch.from_numpy(np.ascontiguousarray(values).reshape(num_rows, num_cols)),
        torch.from_numpy(np.ascontiguousarray(scales, np.float32).reshape(num_rows, -1)),
        None
        if offsets is None
        else torch.from_numpy(np.ascontiguousarray(offsets, np.float32).reshape(num_rows, -1)),
        bits,
        group,
    )

"""Chained prefix-cache hashes of full KV blocks (vLLM's hash_block_tokens, SHA-256).

hash(block i) = SHA-256(hash(block i-1) | token ids as little-endian uint32 | extra keys),
with NONE_HASH as the parent of block 0 and the cache salt as an extra key of block 0. A LoRA
adapter's key (its id, never reused, and its name: lora.py) is an extra key of every block, so
two adapters, or an adapter and the base model, never share a cached block. Every
multimodal item whose placeholders overlap a block adds (its content hash, its offset relative
to the block start) to the block's extra keys (vLLM's mm extra keys), so the same text with
another image never hits.
The parent is always 32 bytes and a block always holds block_size tokens, so the encoding
is unambiguous; the result depends on nothing but these bytes, so it is identical in every
process (no PYTHONHASHSEED). A hit on a hash is trusted: equal hashes mean equal prefixes
(SHA-256 collisions aside), which the tests check against the blocks' real contents.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from core_svc.mm_inputs import MultiModalFeatureSpec

BlockHash = bytes

NONE_HASH: BlockHash = hashlib.sha256(b"splitserve.core.prefix-cache.v1").digest()


def hash_block_tokens(
    parent_block_hash: BlockHash | None, block_token_ids: list[int], extra_keys: bytes = b""
) -> BlockHash:
    """Hash of one full block, chained on its parent's hash."""
    h = hashlib.sha256(NONE_HASH if parent_block_hash is None else parent_block_hash)
    h.update(struct.pack(f"<{len(block_token_ids)}I", *block_token_ids))
    if extra_keys:
        h.update(extra_keys)
    return h.digest()


class BlockHasher:
    """Extends a request's block hashes as its tokens fill blocks."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._pack = struct.Struct(f"<{block_size}I").pack

    def extend(
        self,
        block_hashes: list[BlockHash],
        token_ids: list[int],
        cache_salt: str,
        mm_features: Sequence[MultiModalFeatureSpec] = (),
        lora_key: bytes = b"",
    ) -> None:
        """Append the hashes of the full blocks of token_ids not hashed yet."""
        block_size = self.block_size
        num_full_blocks = len(token_ids) // block_size
        start = len(block_hashes)
        if start >= num_full_blocks:
            return
        pack = self._pack
        sha256 = hashlib.sha256
        parent = block_hashes[-1] if block_hashes else NONE_HASH
        for i in range(start, num_full_blocks):
            h = sha256(parent)
            h.update(pack(*token_ids[i * block_size : (i + 1) * block_size]))
            if i == 0 and cache_salt:
                h.update(cache_salt.encode())
            if mm_features:
                h.update(mm_extra_keys(mm_features, i * block_size, block_size))
            if lora_key:
                h.update(lora_key)
            parent = h.digest()
            block_hashes.append(parent)


def mm_extra_keys(features: Sequence[MultiModalFeatureSpec], start: int, block_size: int) -> bytes:
    """(hash, offset from `start`) of every item overlapping [start, start + block_size),
    length-prefixed so that no two lists encode alike."""
    keys = b""
    end = start + block_size
    for feature in features:
        if feature.offset >= end:
            break
        if feature.end > start:
            identifier = feature.identifier.encode()
            keys += struct.pack("<4sIi", b"mm\0\0", len(identifier), feature.offset - start)
            keys += identifier
    return keys

"""Chained block hashes: stable across processes, salted on the first block only."""

from __future__ import annotations

import os
import subprocess
import sys

from core_svc.kv_cache.block_hash import NONE_HASH, BlockHasher, hash_block_tokens


def hashes_of(token_ids: list[int], block_size: int = 4, salt: str = "") -> list[bytes]:
    block_hashes: list[bytes] = []
    BlockHasher(block_size).extend(block_hashes, token_ids, salt)
    return block_hashes


def test_only_full_blocks_are_hashed_and_extension_is_incremental() -> None:
    tokens = list(range(11))
    assert len(hashes_of(tokens)) == 2
    block_hashes = hashes_of(tokens[:5])
    BlockHasher(4).extend(block_hashes, tokens, "")
    assert block_hashes == hashes_of(tokens)


def test_hasher_matches_the_chained_definition() -> None:
    tokens = [7, 8, 9, 10, 11, 12, 13, 14]
    first = hash_block_tokens(None, tokens[:4], b"salt")
    second = hash_block_tokens(first, tokens[4:])
    assert hashes_of(tokens, salt="salt") == [first, second]
    assert hash_block_tokens(NONE_HASH, tokens[:4], b"salt") == first


def test_hash_commits_to_the_whole_prefix() -> None:
    a = hashes_of([1, 2, 3, 4, 5, 6, 7, 8])
    b = hashes_of([1, 2, 3, 0, 5, 6, 7, 8])
    assert a[0] != b[0] and a[1] != b[1]


def test_salt_changes_every_block_through_the_chain() -> None:
    tokens = list(range(12))
    plain, salted, other = (
        hashes_of(tokens),
        hashes_of(tokens, salt="a"),
        hashes_of(tokens, salt="b"),
    )
    for i in range(3):
        assert len({plain[i], salted[i], other[i]}) == 3


def test_large_token_ids_are_encoded_without_truncation() -> None:
    assert hashes_of([2**32 - 1] * 4) != hashes_of([2**31 - 1] * 4)


def test_hashes_are_identical_in_another_python_process() -> None:
    code = (
        "from core_svc.kv_cache.block_hash import BlockHasher\n"
        "h = []\n"
        "BlockHasher(4).extend(h, list(range(100, 112)), 'salt')\n"
        "print(','.join(x.hex() for x in h))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    expected = ",".join(x.hex() for x in hashes_of(list(range(100, 112)), salt="salt"))
    assert result.stdout.strip() == expected

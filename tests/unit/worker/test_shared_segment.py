"""Same-host KV delivery's segments: a producer opens only a consumer's segment of exactly the
transfer's size; a consumer makes none that /dev/shm cannot hold; a producer's chunk said to be
in a segment the pull never offered fails the load."""

from __future__ import annotations

import os

import pytest

from splitserve_contracts.kv.v1 import kv_transfer_pb2 as kv_pb
from splitserve_runtime.channels import ChannelSecurity
from splitserve_runtime.tls import WORKER_ROLE
from tests.fixtures.kv_peers import CacheShape, make_cache, make_layout
from worker_svc.kv_connector import shared_segment
from worker_svc.kv_connector.block_io import BlockIO
from worker_svc.kv_connector.chunk_writer import LoadFailed
from worker_svc.kv_connector.pulls import Pulls
from worker_svc.kv_connector.reports import Reports


def test_a_producer_opens_only_a_consumers_segment_that_holds_the_transfer() -> None:
    segment = shared_segment.create_segment(4096)
    assert segment is not None
    try:
        assert shared_segment.NAME.fullmatch(segment.name)
        for size in (4096, 1024):
            opened = shared_segment.open_segment(segment.name, size)
            assert opened is not None
            opened.buf[:4] = b"kv!!"
            opened.close()
        assert bytes(segment.buf[:4]) == b"kv!!"  # the consumer sees what the producer wrote
        assert shared_segment.open_segment(segment.name, 8192) is None  # too small for it
        assert shared_segment.open_segment("psm_other", 4096) is None  # not a consumer's
        assert shared_segment.open_segment("splitserve-kv-" + "0" * 32, 4096) is None  # gone
    finally:
        segment.close()
        segment.unlink()


def test_a_consumer_reuses_a_clean_segment_and_retires_one_a_pull_left() -> None:
    pool = shared_segment.SegmentPool()
    try:
        first = pool.take(1000)
        assert first is not None and first.size == shared_segment.SIZE_STEP
        pool.give_back(first, is_clean=True)
        again = pool.take(2000)
        assert again is first
        pool.give_back(again, is_clean=False)
        assert not os.path.exists(f"/dev/shm/{first.name}")
        fresh = pool.take(1000)
        assert fresh is not None and fresh.name != first.name
        pool.give_back(fresh, is_clean=True)
    finally:
        pool.close()
    assert not os.path.exists(f"/dev/shm/{fresh.name}")


def test_a_segment_dev_shm_cannot_hold_is_not_offered(monkeypatch: pytest.MonkeyPatch) -> None:
    before = set(os.listdir("/dev/shm"))

    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shared_segment.os, "posix_fallocate", full)
    assert shared_segment.create_segment(1 << 20) is None
    assert set(os.listdir("/dev/shm")) == before


def test_a_chunk_in_a_segment_the_pull_did_not_offer_fails_the_load() -> None:
    shape = CacheShape()
    blocks = BlockIO(make_cache(shape))
    pulls = Pulls(blocks, make_layout(shape), ChannelSecurity(None, WORKER_ROLE), Reports())
    try:
        chunk = kv_pb.PullKvResponse(layer=0, first_block=0, num_blocks=1, in_shared_memory=True)
        with pytest.raises(LoadFailed, match="did not offer"):
            pulls._chunk_data(chunk, None, 1)
        both = kv_pb.PullKvResponse(num_blocks=1, data=b"x", in_shared_memory=True)
        segment = shared_segment.create_segment(blocks.block_bytes * blocks.num_layers)
        assert segment is not None
        try:
            with pytest.raises(LoadFailed, match="or in both"):
                pulls._chunk_data(both, segment, 1)
        finally:
            segment.close()
            segment.unlink()
    finally:
        pulls.shutdown()

"""The engine core frees the KV blocks that fell out of a sliding window (every layer of the
tiny Mistral attends to its last 6 tokens): a real worker behind the real scheduler, in a cache
too small for the requests' full sequences, still generates exactly what transformers does,
while freed blocks are handed to other requests (and the workers' stale table entries are
masked out). The same with --async-scheduling: a block freed while a step in flight still
reads it is reused only by a later step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from core_svc.engine.engine_core import EngineCore
from core_svc.sched.scheduler_config import CacheConfig, SchedulerConfig
from splitserve.inprocess import InProcessExecutor
from tests.fixtures.checkpoints import CheckpointCache
from tests.fixtures.parity import reference_generate
from tests.parity.conftest import reference_for
from tests.unit.core.fake_executor import ClientView, make_request
from worker_svc.model_loader.model_load import LoadModelConfig
from worker_svc.worker import Worker

BLOCK_SIZE = 4
NUM_BLOCKS = 20  # 19 usable: 4 requests of 38-46 tokens would need 40 without freeing
MAX_TOKENS = 18
SHARED = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
PROMPTS = [
    SHARED + [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45],
    [5, 9, 33, 7, 100, 200, 3, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
    SHARED + [77, 78, 79, 80, 81, 82, 83, 84, 85, 86],
    [300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311, 312, 313, 314, 315, 316],
]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_blocks_out_of_the_window_are_freed_and_outputs_stay_exact(
    checkpoints: CheckpointCache, references: dict[Path, Any], async_scheduling: bool
) -> None:
    path = checkpoints.get("mistral_window")
    worker = Worker("cpu")
    config = LoadModelConfig.of(
        str(path), block_size=BLOCK_SIZE, max_model_len=64, async_scheduling=async_scheduling
    )
    loaded = worker.load_model(config)
    assert loaded.sliding_window == 6
    worker.initialize_kv_cache(NUM_BLOCKS)
    engine = EngineCore(
        SchedulerConfig.of(
            max_num_seqs=4,
            max_num_batched_tokens=12,
            max_model_len=64,
            async_scheduling=async_scheduling,
        ),
        CacheConfig.of(NUM_BLOCKS, 6, block_size=BLOCK_SIZE, enable_prefix_caching=True),
        InProcessExecutor(worker),
    )
    for handle, prompt in enumerate(PROMPTS):
        engine.add_request(make_request(handle, prompt, max_tokens=MAX_TOKENS, temperature=0.0))
    view = ClientView()
    pool = engine.kv_cache_manager.block_pool
    peak_running, nulls_seen = 0, False
    try:
        for _ in range(400):
            if not engine.has_work():
                break
            view.absorb(engine.step())
            peak_running = max(peak_running, len(engine.scheduler.running))
            held = engine.kv_cache_manager.req_to_blocks.values()
            nulls_seen |= any(pool.null_block in blocks for blocks in held)
    finally:
        engine.shutdown()
    assert not engine.has_unfinished_requests()
    assert nulls_seen and peak_running == len(PROMPTS)  # all ran at once in 19 blocks
    reference = reference_for(references, path)
    for handle, prompt in enumerate(PROMPTS):
        assert view.tokens[(1, handle)] == reference_generate(reference, prompt, MAX_TOKENS)
    assert pool.get_num_used_blocks() == 0 and pool.null_block.ref_cnt == 0

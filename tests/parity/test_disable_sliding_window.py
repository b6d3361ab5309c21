"""--disable-sliding-window (vLLM's ModelConfig.disable_sliding_window) on a tiny Mistral whose
every layer attends to its last 16 tokens: the rank serves it with full attention and its length
capped to the window (max_model_len 16 instead of 512; a longer one is refused), and reports no
window, so the engine core frees no KV block. What it generates is exactly what transformers
generates from the same files with the window switched off (`sliding_window=None`, which
transformers' Mistral honours: past the window its logits differ from the windowed model's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from core_svc.engine.engine_core import EngineCore
from core_svc.sched.scheduler_config import CacheConfig, SchedulerConfig
from splitserve.inprocess import InProcessExecutor
from tests.fixtures.checkpoints import CheckpointCache
from tests.fixtures.parity import reference_generate, reference_logits
from tests.parity.conftest import reference_for
from tests.unit.core.fake_executor import ClientView, make_request
from worker_svc.model_loader.model_load import LoadModelConfig
from worker_svc.worker import Worker

WINDOW = 16
BLOCK_SIZE = 4
NUM_BLOCKS = 16
PROMPTS = [
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
    [5, 9, 33, 7, 100, 200, 3],
    [300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311],
]


def windowed_checkpoint(checkpoints: CheckpointCache) -> Path:
    return checkpoints.get("mistral_window", sliding_window=WINDOW)


def full_attention_reference(path: Path) -> Any:
    """transformers' model of the same files with the window switched off."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, sliding_window=None
    )
    assert model.config.sliding_window is None
    return model.eval()


def test_transformers_honours_the_switch_past_the_window(
    checkpoints: CheckpointCache, references: dict[Path, Any]
) -> None:
    """The oracle is not the windowed model in disguise: the same up to the window (why vLLM
    caps the length to it), different past it."""
    path = windowed_checkpoint(checkpoints)
    tokens = [3 + (7 * i) % 500 for i in range(2 * WINDOW)]
    windowed = reference_logits(reference_for(references, path), tokens)
    full = reference_logits(full_attention_reference(path), tokens)
    assert torch.allclose(windowed[:WINDOW], full[:WINDOW], atol=1e-5)
    assert float((windowed[WINDOW:] - full[WINDOW:]).abs().max()) > 1e-2


def test_the_rank_serves_full_attention_capped_to_the_window(
    checkpoints: CheckpointCache,
) -> None:
    path = windowed_checkpoint(checkpoints)
    windowed = Worker("cpu").load_model(LoadModelConfig.of(str(path), block_size=BLOCK_SIZE))
    assert (windowed.sliding_window, windowed.max_model_len) == (WINDOW, 512)
    worker = Worker("cpu")
    config = LoadModelConfig.of(str(path), block_size=BLOCK_SIZE, disable_sliding_window=True)
    loaded = worker.load_model(config)
    assert (loaded.sliding_window, loaded.max_model_len) == (0, WINDOW)
    assert worker.model_config is not None
    assert all(worker.model_config.layer_window(i) is None for i in range(2))
    with pytest.raises(ValueError, match="max_model_len 17 exceeds the model's limit of 16"):
        Worker("cpu").load_model(config.with_options(max_model_len=WINDOW + 1))
    worker.initialize_kv_cache(NUM_BLOCKS)
    engine = EngineCore(
        SchedulerConfig.of(max_num_seqs=4, max_num_batched_tokens=12, max_model_len=WINDOW),
        CacheConfig.of(NUM_BLOCKS, loaded.sliding_window, block_size=BLOCK_SIZE),
        InProcessExecutor(worker),
    )
    for handle, prompt in enumerate(PROMPTS):
        max_tokens = WINDOW - len(prompt)  # up to max_model_len
        engine.add_request(make_request(handle, prompt, max_tokens=max_tokens, temperature=0.0))
    view = ClientView()
    try:
        for _ in range(100):
            if not engine.has_work():
                break
            view.absorb(engine.step())
    finally:
        engine.shutdown()
    assert not engine.has_unfinished_requests()
    reference = full_attention_reference(path)
    for handle, prompt in enumerate(PROMPTS):
        expected = reference_generate(reference, prompt, WINDOW - len(prompt))
        assert view.tokens[(1, handle)] == expected

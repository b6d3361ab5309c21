"""What a rank says while it loads: vLLM's shard progress bar (rank 0, text logs) or a line per
shard, and the --enforce-eager switch arriving from the engine core's LoadModel."""

from __future__ import annotations

import logging

import pytest

from tests.fixtures.checkpoints import CheckpointCache
from tests.fixtures.load_requests import load_request
from worker_svc import convert
from worker_svc.model_loader.weights import SHARDS_PROGRESS, checkpoint_files, iter_checkpoint


def test_shards_show_vllms_progress_bar_when_asked(
    worker_checkpoints: CheckpointCache, capsys: pytest.CaptureFixture[str]
) -> None:
    files = checkpoint_files(worker_checkpoints.get("llama", max_shard_size="100KB"))
    names = [name for name, _ in iter_checkpoint(files, show_progress=True)]
    err = capsys.readouterr().err
    assert names and f"{SHARDS_PROGRESS}: 100%" in err and f"{len(files)}/{len(files)}" in err


def test_without_the_bar_every_shard_is_a_log_line(
    worker_checkpoints: CheckpointCache,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    files = checkpoint_files(worker_checkpoints.get("llama", max_shard_size="100KB"))
    with caplog.at_level(logging.INFO, logger="worker_svc.model_loader.weights"):
        list(iter_checkpoint(files))
    lines = [r.getMessage() for r in caplog.records if r.name == "worker_svc.model_loader.weights"]
    assert len(lines) == len(files) > 1
    assert lines[-1].startswith(f"loaded shard {len(files)}/{len(files)}")
    assert SHARDS_PROGRESS not in capsys.readouterr().err


def test_enforce_eager_travels_in_load_model() -> None:
    request = load_request(model_path="/m", block_size=8, enforce_eager=True)
    assert convert.load_model_config_from_proto(request).options.model.enforce_eager is True
    plain = load_request(model_path="/m", block_size=8)
    assert convert.load_model_config_from_proto(plain).options.model.enforce_eager is False


def test_async_scheduling_travels_in_load_model_and_refuses_pipeline_stages() -> None:
    request = load_request(model_path="/m", block_size=8, async_scheduling=True)
    assert convert.load_model_config_from_proto(request).options.scheduler.async_scheduling is True
    staged = load_request(
        model_path="/m", block_size=8, async_scheduling=True, pipeline_parallel_size=2
    )
    with pytest.raises(
        ValueError, match="scheduler.async_scheduling needs parallel.pipeline_parallel_size 1"
    ):
        convert.load_model_config_from_proto(staged)

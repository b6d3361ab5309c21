"""gpt-oss with MXFP4 experts (OpenAI's checkpoint format) against transformers loading the same
folder: the experts dequantized at load, float32 logits of every computed position within 1e-4
and greedy tokens equal to `generate`, over a chunked prefill with decodes, at TP=1, TP=2 (every
expert's slice dequantized on both ranks) and with expert parallelism (whole experts). MXFP4
moves these weights by up to a fifth of their largest value, so a load that took any other
weights would miss by far more than the tolerance. An mxfp4 checkpoint of another family is
refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.checkpoints import CheckpointCache, load_reference
from tests.fixtures.mxfp4_checkpoints import QUANTIZATION_CONFIG, make_mxfp4_checkpoint
from tests.fixtures.parity import max_logit_diff, reference_generate, run_recording
from tests.fixtures.ranks import LocalRank, SpawnedRanks
from tests.fixtures.step_driver import StepDriver
from tests.parity.test_parity_families import BLOCK_SIZE, PROMPTS, TOLERANCE
from worker_svc.model_loader.model_load import LoadModelConfig
from worker_svc.worker import Worker


@pytest.fixture(scope="module")
def mxfp4_path(checkpoints: CheckpointCache, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("mxfp4") / "gpt-oss-mxfp4"
    return make_mxfp4_checkpoint(checkpoints.get("gpt_oss"), target)


@pytest.fixture(scope="module")
def reference(mxfp4_path: Path) -> Any:
    return load_reference(mxfp4_path)


def check_parity(ranks: Any, reference: Any) -> None:
    driver = StepDriver(BLOCK_SIZE, chunk_size=5)
    handles = [driver.add(p, max_tokens=6) for p in PROMPTS]
    assert max_logit_diff(driver, run_recording(driver, ranks), reference) < TOLERANCE
    for handle, prompt in zip(handles, PROMPTS, strict=True):
        assert driver.requests[handle].outputs == reference_generate(reference, prompt, 6)


def test_mxfp4_experts_match_transformers_at_tp1(mxfp4_path: Path, reference: Any) -> None:
    rank = LocalRank()
    try:
        rank.load(LoadModelConfig.of(str(mxfp4_path), block_size=BLOCK_SIZE))
        rank.init(num_blocks=128)
        check_parity(rank, reference)
    finally:
        rank.close()


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_mxfp4_experts_match_transformers_at_tp2(
    group: SpawnedRanks, mxfp4_path: Path, reference: Any, expert_parallel: bool
) -> None:
    config = LoadModelConfig.of(
        str(mxfp4_path),
        tensor_parallel_size=2,
        block_size=BLOCK_SIZE,
        enable_expert_parallel=expert_parallel,
    )
    group.load(config)
    try:
        group.init(num_blocks=128)
        check_parity(group, reference)
    finally:
        group.shutdown_model()


def test_an_mxfp4_checkpoint_of_another_family_is_refused(
    checkpoints: CheckpointCache, tmp_path: Path
) -> None:
    path = tmp_path / "llama-mxfp4"
    shutil.copytree(checkpoints.get("llama"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(
        json.dumps(config | {"quantization_config": QUANTIZATION_CONFIG})
    )
    with pytest.raises(ValueError, match="mxfp4 is read for gpt-oss's experts"):
        Worker("cpu").load_model(LoadModelConfig.of(str(path)))

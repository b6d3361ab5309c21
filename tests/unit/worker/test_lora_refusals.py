"""A rank refuses, in one line saying why, the adapters it cannot serve (vLLM's refusals), and
the requests whose adapter cannot run; the adapters it can serve it reads in well under a
second. Adapters are made by peft on the tiny Llama (or hand-edited from one)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.checkpoints import CheckpointCache
from tests.fixtures.lora_adapters import make_adapter
from tests.fixtures.ranks import LocalRank
from tests.fixtures.step_driver import StepDriver
from worker_svc.lora.peft_config import AdapterError, AdapterNotFound
from worker_svc.model_loader.model_load import LoadModelConfig
from worker_svc.worker import WorkerStateError


@pytest.fixture(scope="module")
def base(worker_checkpoints: CheckpointCache) -> Path:
    return worker_checkpoints.get("llama")


@pytest.fixture(scope="module")
def rank(base: Path) -> Iterator[LocalRank]:
    rank = LocalRank()
    config = LoadModelConfig.of(str(base), block_size=4, max_loras=2, max_lora_rank=8)
    rank.load(config.with_options(max_cpu_loras=2))
    rank.init(num_blocks=64)
    yield rank
    rank.close()


@pytest.fixture(scope="module")
def adapters(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora-refusals")
    make_adapter(base, root / "good", seed=1)
    make_adapter(base, root / "rank16", seed=2, rank=16)
    make_adapter(base, root / "dora", seed=3, use_dora=True)
    make_adapter(base, root / "embed", seed=4, targets=("embed_tokens",))
    make_adapter(base, root / "lm-head", seed=5, targets=("lm_head",))
    pickled = root / "pickled"
    shutil.copytree(root / "good", pickled)
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    return root


def read(rank: LocalRank, path: Path | str) -> str:
    with pytest.raises(AdapterError) as info:
        rank.worker.read_lora_adapter(7, str(path))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_refusals_say_why(rank: LocalRank, adapters: Path) -> None:
    assert "LoRA rank 16 is greater than max_lora_rank 8." in read(rank, adapters / "rank16")
    assert "DoRA" in read(rank, adapters / "dora")
    assert "LoRA on model.embed_tokens is not supported" in read(rank, adapters / "embed")
    assert "LoRA on lm_head is not supported" in read(rank, adapters / "lm-head")
    assert "pickle" in read(rank, adapters / "pickled")
    assert "without '..'" in read(rank, f"{adapters}/../{adapters.name}/good")
    assert "absolute" in read(rank, "good")
    with pytest.raises(AdapterNotFound, match="No adapter found"):
        rank.worker.read_lora_adapter(7, str(adapters / "missing"))


def test_adapter_of_another_model_is_refused(
    rank: LocalRank, adapters: Path, worker_checkpoints: CheckpointCache, tmp_path: Path
) -> None:
    other = worker_checkpoints.get("llama", hidden_size=32, intermediate_size=64)
    message = read(rank, make_adapter(other, tmp_path / "other", seed=1))
    assert "trained for another model" in message


def test_a_broken_config_is_refused(rank: LocalRank, adapters: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(adapters / "good", broken)
    config = json.loads((broken / "adapter_config.json").read_text())
    (broken / "adapter_config.json").write_text(json.dumps({**config, "r": -1}))
    assert "positive integer" in read(rank, broken)
    (broken / "adapter_config.json").write_text("{not json")
    assert "not valid JSON" in read(rank, broken)


def test_requests_whose_adapter_cannot_run_are_refused_alone(
    rank: LocalRank, adapters: Path
) -> None:
    """An adapter whose files are gone by its first slot fails its requests with the reason;
    the base model's request in the same step runs."""
    driver = StepDriver(4, lora_paths={9: str(adapters / "missing")})
    driver.next_handle = 500
    base = driver.add([5, 6, 7], max_tokens=1)
    broken = driver.add([5, 6, 7], max_tokens=1, lora_id=9)
    output = rank.execute(driver.next_step())
    assert output is not None
    assert output.req_handles == [base]
    assert output.failed_req_handles == [broken]
    assert "No adapter found" in output.failed_reasons[0]
    driver.finished.append(base)
    rank.execute(driver.next_step())


def test_an_adapter_loads_fast_and_lora_off_ranks_refuse(
    base: Path, rank: LocalRank, adapters: Path
) -> None:
    adapter = rank.worker.read_lora_adapter(3, str(adapters / "good"))
    assert adapter.load_seconds < 1.0
    assert adapter.target_modules == ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                      "up_proj", "v_proj")  # fmt: skip
    plain = LocalRank()
    try:
        plain.load(LoadModelConfig.of(str(base), block_size=4))
        plain.init(num_blocks=16)
        with pytest.raises(WorkerStateError, match="LoRA is off"):
            plain.worker.read_lora_adapter(3, str(adapters / "good"))
        driver = StepDriver(4, lora_paths={3: str(adapters / "good")})
        driver.add([5, 6, 7], max_tokens=1, lora_id=3)
        step = dataclasses.replace(driver.next_step(), lora_slots=None)
        output = plain.execute(step)
        assert output is not None and "LoRA is off" in output.failed_reasons[0]
    finally:
        plain.close()

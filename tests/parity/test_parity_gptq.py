"""GPTQ checkpoints packed by GPTQModel's own code (tests/fixtures/gptq_checkpoints.py): 4-bit
with and without act-order (desc_act) and 8-bit with act-order, against transformers running
the same weights as GPTQModel's `dequantize_weight` unpacks them (float32 logits within 1e-4:
the kernels hold every weight exactly and sum in float32; a wrong group, zero point or column
order is off by whole units), and against transformers loading the checkpoint itself through
optimum and GPTQModel's `torch` kernel (within 2e-2: that kernel rounds each dequantized weight
to float16); greedy tokens equal, at TP=1 (TP=2: tests/e2e/test_gptq_serve.py serves the
act-order checkpoint with `splitserve serve -tp 2`)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fixtures.checkpoints import CheckpointCache, load_reference
from tests.fixtures.gptq_checkpoints import gptqmodel_error, make_gptq_checkpoint
from tests.fixtures.parity import max_logit_diff, reference_generate, run_recording
from tests.fixtures.ranks import LocalRank
from tests.fixtures.step_driver import StepDriver
from worker_svc.layers.quantized import WeightOnlyLinearMethod
from worker_svc.model_loader.model_load import LoadModelConfig

pytestmark = pytest.mark.skipif(gptqmodel_error() is not None, reason=str(gptqmodel_error()))
PROMPTS = [[5, 9, 33, 7, 100, 200, 3, 8, 9, 10, 11, 12, 13], [40, 41, 42]]
BLOCK_SIZE = 4
TOLERANCE = 1e-4
TRANSFORMERS_TOLERANCE = 2e-2
"""transformers' own GPTQ path runs GPTQModel's TorchLinear, which dequantizes every weight into
its scales' float16 before the matmul (a relative rounding of up to 2^-11 per weight, through
two layers: 4.9e-3 measured on these logits of magnitude <= 6); a wrong group, zero point or
column order is off by whole units (4.3 to 4.8 measured with act-order ignored)."""
CASES = {"4bit": (4, False), "4bit-act-order": (4, True), "8bit-act-order": (8, True)}


@pytest.fixture(scope="module")
def gptq_cases(
    checkpoints: CheckpointCache, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, tuple[Path, Any]]]:
    source = checkpoints.get("llama")
    root = tmp_path_factory.mktemp("gptq")
    cases = {}
    for name, (bits, desc_act) in CASES.items():
        path, weights = make_gptq_checkpoint(source, root / name, bits, desc_act)
        reference = load_reference(source)
        state = reference.state_dict()
        with torch.no_grad():
            for key, weight in weights.items():
                state[key].copy_(weight)
        cases[name] = (path, reference)
    yield cases


@pytest.fixture(scope="module")
def legacy_case(gptq_cases: dict[str, tuple[Path, Any]]) -> tuple[Path, Any]:
    """The 4-bit checkpoint as AutoGPTQ wrote it: quantize_config.json beside a config.json
    without quantization_config."""
    path, reference = gptq_cases["4bit"]
    legacy = path.parent / "4bit-legacy"
    shutil.copytree(path, legacy)
    config = json.loads((legacy / "config.json").read_text())
    quantization = config.pop("quantization_config")
    (legacy / "config.json").write_text(json.dumps(config))
    (legacy / "quantize_config.json").write_text(json.dumps(quantization))
    return legacy, reference


def transformers_gptq(path: Path, bits: int) -> Any:
    """transformers loading the checkpoint itself (optimum + GPTQModel's `torch` kernel, which
    runs without building anything)."""
    from transformers import AutoModelForCausalLM, GPTQConfig

    config = GPTQConfig(bits=bits, backend="torch")
    return AutoModelForCausalLM.from_pretrained(
        str(path), device_map="cpu", dtype=torch.float32, quantization_config=config
    ).eval()


def drive(ranks: Any, reference: Any, transformers_model: Any = None) -> None:
    """Our logits and greedy tokens against the dequantized reference (and, when given,
    transformers running the checkpoint)."""
    driver = StepDriver(BLOCK_SIZE, chunk_size=5)
    handles = [driver.add(p, max_tokens=5) for p in PROMPTS]
    ours = run_recording(driver, ranks)
    checks = [(reference, TOLERANCE), (transformers_model, TRANSFORMERS_TOLERANCE)]
    with torch.compiler.set_stance("force_eager"):  # GPTQModel's kernel asks torch.compile
        for model, tolerance in checks:
            if model is None:
                continue
            assert max_logit_diff(driver, ours, model) < tolerance
            for handle, prompt in zip(handles, PROMPTS, strict=True):
                assert driver.requests[handle].outputs == reference_generate(model, prompt, 5)


@pytest.mark.parametrize("name", list(CASES))
def test_gptq_matches_gptqmodel_dequantized(
    gptq_cases: dict[str, tuple[Path, Any]], name: str
) -> None:
    path, reference = gptq_cases[name]
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["desc_act"]) == ("gptq", CASES[name][1])
    rank = LocalRank()
    try:
        rank.load(LoadModelConfig.of(str(path), block_size=BLOCK_SIZE))  # the checkpoint's own
        rank.init(num_blocks=64)
        runner = rank.worker.runner
        assert runner is not None
        methods = [getattr(m, "method", None) for m in runner.model.modules()]
        assert sum(isinstance(m, WeightOnlyLinearMethod) for m in methods) == 8  # 2 layers x 4
        drive(rank, reference, transformers_gptq(path, CASES[name][0]))
    finally:
        rank.close()


def test_quantize_config_json_is_read_with_quantization_gptq(legacy_case: tuple[Path, Any]) -> None:
    """As vLLM: AutoGPTQ's quantize_config.json counts when --quantization gptq asks for it."""
    path, reference = legacy_case
    rank = LocalRank()
    try:
        rank.load(LoadModelConfig.of(str(path), block_size=BLOCK_SIZE, quantization="gptq"))
        rank.init(num_blocks=64)
        drive(rank, reference)
    finally:
        rank.close()

"""Quantized weights served at TP=1 and TP=2 (packed int8/int4 weights, their scales and
offsets split over the ranks: column-parallel by rows, row-parallel by whole groups).

- `--quantization int8` / `int4` on a float Llama (hidden 256: int4's 32-column groups fall
  whole on each row-parallel rank, as at TP=1): the reference is transformers on the same checkpoint
  with every linear weight replaced by its quantized-then-dequantized value (the LM head: int8
  per row), so the test checks the serving path (packing, sharding, kernels) exactly; the
  quantizer's quality is measured separately (benchmarks/quant_quality.py).
- a Q4_1 GGUF file (32-column groups with offsets) at TP=2 against transformers loading the
  same file.

float32 logits of every computed position within 1e-4, greedy tokens equal to `generate`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fixtures.checkpoints import CheckpointCache, load_reference
from tests.fixtures.gguf_files import write_gguf
from tests.fixtures.parity import max_logit_diff, reference_generate, run_recording
from tests.fixtures.ranks import LocalRank, SpawnedRanks
from tests.fixtures.step_driver import StepDriver
from worker_svc.layers.quantized import DEQUANTIZE_ROWS
from worker_svc.model_loader.model_load import LoadModelConfig
from worker_svc.quantization.online import INT4_GROUPS, INT8_PER_ROW, OnlineScheme

PROMPTS = [[5, 9, 33, 7, 100, 200, 3, 8, 9, 10, 11, 12, 13], [40, 41, 42]]
BLOCK_SIZE = 4
TOLERANCE = 1e-4
WIDE = {"hidden_size": 256, "intermediate_size": 512}
SCHEMES = {"int8": INT8_PER_ROW, "int4": INT4_GROUPS}


def quantized_reference(path: Path, scheme: OnlineScheme) -> Any:
    """transformers on `path` with the weights `--quantization` serves, dequantized."""
    model = load_reference(path)
    with torch.no_grad():
        for layer in model.model.layers:
            for module in layer.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.copy_(scheme.quantize(module.weight).dequantize())
        model.lm_head.weight.copy_(INT8_PER_ROW.quantize(model.lm_head.weight).dequantize())
    return model


def drive(ranks: Any, reference: Any, prompts: list[list[int]] = PROMPTS, chunk: int = 5) -> None:
    driver = StepDriver(BLOCK_SIZE, chunk_size=chunk)
    handles = [driver.add(p, max_tokens=5) for p in prompts]
    assert max_logit_diff(driver, run_recording(driver, ranks), reference) < TOLERANCE
    for handle, prompt in zip(handles, prompts, strict=True):
        assert driver.requests[handle].outputs == reference_generate(reference, prompt, 5)


def serve(ranks: Any, config: LoadModelConfig, reference: Any, *args: Any) -> None:
    ranks.load(config)
    try:
        ranks.init(num_blocks=64)
        drive(ranks, reference, *args)
    finally:
        ranks.close() if isinstance(ranks, LocalRank) else ranks.shutdown_model()


@pytest.mark.parametrize("method", list(SCHEMES))
def test_online_quantization_at_tp1(checkpoints: CheckpointCache, method: str) -> None:
    path = checkpoints.get("llama", **WIDE)
    reference = quantized_reference(path, SCHEMES[method])
    config = LoadModelConfig.of(str(path), block_size=BLOCK_SIZE, quantization=method)
    serve(LocalRank(), config, reference)
    # one prefill step of DEQUANTIZE_ROWS tokens or more: oneDNN's matmul on the dequantized weight
    serve(LocalRank(), config, reference, [list(range(100, 100 + DEQUANTIZE_ROWS + 3))], 1 << 30)


@pytest.mark.slow
@pytest.mark.parametrize("method", list(SCHEMES))
def test_online_quantization_at_tp2(
    checkpoints: CheckpointCache, group: SpawnedRanks, method: str
) -> None:
    path = checkpoints.get("llama", **WIDE)
    reference = quantized_reference(path, SCHEMES[method])
    config = LoadModelConfig.of(
        str(path), block_size=BLOCK_SIZE, quantization=method, tensor_parallel_size=2
    )
    serve(group, config, reference)


@pytest.mark.slow
def test_gguf_q4_1_at_tp2(
    checkpoints: CheckpointCache, group: SpawnedRanks, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from splitserve_runtime.tiny_model import write_tokenizer
    from tests.fixtures.checkpoints import VOCAB_SIZE

    write_tokenizer(tmp_path / "tokenizer", vocab_size=VOCAB_SIZE)
    source = checkpoints.get("llama")
    path = write_gguf(tmp_path / "tiny.gguf", source, tmp_path / "tokenizer", "Q4_1", "llama")
    reference = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    config = LoadModelConfig.of(str(path), block_size=BLOCK_SIZE, tensor_parallel_size=2)
    serve(group, config, reference)

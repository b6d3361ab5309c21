"""AWQ and compressed-tensors checkpoints served end to end as an operator from vLLM runs them:
`splitserve serve FOLDER --quantization NAME` and the openai SDK (GPTQ's is
test_gptq_serve.py, GGUF's test_model_sources.py). The checkpoints are made by the upstream
libraries' own code (AutoAWQ's WQLinear_GEMM packing; compressed-tensors' pack-quantized
compressor, 4-bit with zero points); the reference is transformers on the weights those
libraries unpack (AutoAWQ's `dequantize_gemm`; transformers decompressing with
compressed-tensors). Greedy text equal, each token's logprob within 1e-4 (the kernels hold
every weight exactly and sum in float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from splitserve_runtime.tiny_model import write_tokenizer
from tests.fixtures.awq_checkpoints import make_awq_checkpoint
from tests.fixtures.checkpoints import VOCAB_SIZE, CheckpointCache
from tests.fixtures.ct_checkpoints import make_ct_checkpoint
from tests.fixtures.serve_cli import (
    assert_same_completion,
    reference_completion,
    reference_with,
    serve_completion,
)

pytestmark = pytest.mark.slow
PROMPT = [5, 9, 33, 7, 100, 200, 3]
NUM_TOKENS = 8


def test_an_awq_checkpoint_serves_end_to_end(tmp_path: Path) -> None:
    source = CheckpointCache(tmp_path / "checkpoints").get("llama")
    folder, weights = make_awq_checkpoint(source, tmp_path / "tiny-awq")
    write_tokenizer(folder, vocab_size=VOCAB_SIZE)
    tokens, logprobs = reference_completion(reference_with(source, weights), PROMPT, NUM_TOKENS)
    reply = serve_completion(folder, tmp_path, ["--quantization", "awq"], PROMPT, NUM_TOKENS)
    assert_same_completion(reply, folder, tokens, logprobs)
    assert "awq (weight-only): 8 linear layers" in (tmp_path / "serve.err").read_text()


def test_a_compressed_tensors_checkpoint_serves_end_to_end(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    source = CheckpointCache(tmp_path / "checkpoints").get("llama")
    folder = make_ct_checkpoint(source, tmp_path / "tiny-ct", "w4a16-pack-asym")
    write_tokenizer(folder, vocab_size=VOCAB_SIZE)
    reference = AutoModelForCausalLM.from_pretrained(
        str(folder),
        dtype=torch.float32,
        quantization_config=CompressedTensorsConfig(dequantize=True),
    ).eval()
    tokens, logprobs = reference_completion(reference, PROMPT, NUM_TOKENS)
    flags = ["--quantization", "compressed-tensors"]
    reply = serve_completion(folder, tmp_path, flags, PROMPT, NUM_TOKENS)
    assert_same_completion(reply, folder, tokens, logprobs)
    assert (
        "compressed-tensors (weight-only): 8 linear layers" in (tmp_path / "serve.err").read_text()
    )

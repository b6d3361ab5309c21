"""A GPTQ checkpoint (4-bit, act-order, packed by GPTQModel: tests/fixtures/gptq_checkpoints.py)
served end to end as an operator from vLLM runs it: `splitserve serve FOLDER -tp 2
--quantization gptq_marlin` (vLLM's GPU kernel name, served here by the CPU kernels; each rank
holds its slice of the packed words, zero points, scales and g_idx) and the openai SDK. The
greedy completion equals transformers on GPTQModel's dequantized weights, and each token's
logprob is within 1e-4 of transformers' (the kernels hold every weight exactly and sum in
float32; a wrong group or column order is off by whole units)."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitserve_runtime.tiny_model import write_tokenizer
from tests.fixtures.checkpoints import VOCAB_SIZE, CheckpointCache
from tests.fixtures.gptq_checkpoints import gptqmodel_error, make_gptq_checkpoint
from tests.fixtures.serve_cli import (
    assert_same_completion,
    reference_completion,
    reference_with,
    serve_completion,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(gptqmodel_error() is not None, reason=str(gptqmodel_error())),
]
PROMPT = [5, 9, 33, 7, 100, 200, 3]
NUM_TOKENS = 8


@pytest.mark.extended  # make test: GPTQ parity (TP=1); AWQ, compressed-tensors served
def test_a_gptq_checkpoint_serves_end_to_end_at_tp2(tmp_path: Path) -> None:
    source = CheckpointCache(tmp_path / "checkpoints").get("llama")
    folder, weights = make_gptq_checkpoint(source, tmp_path / "tiny-gptq", 4, desc_act=True)
    write_tokenizer(folder, vocab_size=VOCAB_SIZE)
    tokens, logprobs = reference_completion(reference_with(source, weights), PROMPT, NUM_TOKENS)
    flags = ["-tp", "2", "--quantization", "gptq_marlin"]
    reply = serve_completion(folder, tmp_path, flags, PROMPT, NUM_TOKENS)
    assert_same_completion(reply, folder, tokens, logprobs)
    assert "gptq (weight-only): 8 linear layers" in (tmp_path / "serve.err").read_text()

"""A GPTQ checkpoint (4-bit, act-order, packed by GPTQModel: tests/fixtures/gptq_checkpoints.py)
served end to end as an operator from vLLM runs it: `splitserve serve FOLDER -tp 2
--quantization gptq_marlin` (vLLM's GPU kernel name, served here by the CPU kernels; each rank
holds its slice of the packed words, zero points, scales and g_idx) and the openai SDK. The
greedy completion equals transformers on GPTQModel's dequantized weights, and each token's
logprob is within 1e-4 of transformers' (the kernels hold every weight exactly and sum in
float32; a wrong group or column order is off by whole units)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import torch

from splitserve_runtime.model_cache import default_cache_dir
from splitserve_runtime.tiny_model import write_tokenizer
from tests.fixtures.checkpoints import VOCAB_SIZE, CheckpointCache, load_reference
from tests.fixtures.gptq_checkpoints import gptqmodel_error, make_gptq_checkpoint
from tests.fixtures.parity import reference_generate

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(gptqmodel_error() is not None, reason=str(gptqmodel_error())),
]
BIN = Path(sys.executable).parent
PROMPT = [5, 9, 33, 7, 100, 200, 3]
NUM_TOKENS = 8


def reference_run(source: Path, weights: dict[str, torch.Tensor]) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs, on GPTQModel's dequantized weights."""
    reference = load_reference(source)
    with torch.no_grad():
        for key, weight in weights.items():
            reference.state_dict()[key].copy_(weight)
        tokens = reference_generate(reference, PROMPT, NUM_TOKENS)
        logits = reference(torch.tensor([PROMPT + tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)[len(PROMPT) - 1 : -1]
    return tokens, [float(logprobs[i, t]) for i, t in enumerate(tokens)]


def serve_completion(folder: Path, tmp_path: Path) -> openai.types.Completion:
    cache = tmp_path / "cache"  # the launcher's state file; the built CPU kernels are shared
    cache.mkdir()
    shared = default_cache_dir() / "kernels"
    shared.mkdir(parents=True, exist_ok=True)
    (cache / "kernels").symlink_to(shared, target_is_directory=True)
    env = {**os.environ, "SPLITSERVE_CACHE_DIR": str(cache)}
    command = [str(BIN / "splitserve"), "serve", str(folder), "-tp", "2"]
    command += ["--quantization", "gptq_marlin", "--kv-cache-memory-bytes", "16777216"]
    command += ["--grpc-port", "0", "--http-port", "0", "--frontend-metrics-port", "0"]
    command += ["--core-metrics-port", "0", "--worker-metrics-port", "0"]
    with (tmp_path / "serve.err").open("w") as stderr:
        serve = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    try:
        assert serve.stdout is not None
        line = serve.stdout.readline()
        match = re.match(r"READY .*http=(\S+)", line)
        assert match, (line, (tmp_path / "serve.err").read_text()[-2000:])
        client = openai.OpenAI(base_url=f"http://{match[1]}/v1", api_key="-", max_retries=0)
        return client.completions.create(
            model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=NUM_TOKENS,
            temperature=0.0, logprobs=1, extra_body={"ignore_eos": True},
        )  # fmt: skip
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=90) == 0


def test_a_gptq_checkpoint_serves_end_to_end_at_tp2(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    source = CheckpointCache(tmp_path / "checkpoints").get("llama")
    folder, weights = make_gptq_checkpoint(source, tmp_path / "tiny-gptq", 4, desc_act=True)
    write_tokenizer(folder, vocab_size=VOCAB_SIZE)
    tokens, logprobs = reference_run(source, weights)
    reply = serve_completion(folder, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    assert reply.choices[0].text == tokenizer.decode(tokens, skip_special_tokens=True)
    ours = reply.choices[0].logprobs
    assert ours is not None and ours.token_logprobs is not None
    assert max(abs(a - b) for a, b in zip(ours.token_logprobs, logprobs, strict=True)) < 1e-4
    assert "gptq (weight-only): 8 linear layers" in (tmp_path / "serve.err").read_text()

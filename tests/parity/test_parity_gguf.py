"""GGUF files against transformers loading the same file (`from_pretrained(..., gguf_file=...)`).

Tiny files are written with gguf's GGUFWriter as llama.cpp writes them (tests/fixtures/
gguf_files.py): F32, and quantized Q8_0 / Q4_1 (the default model's types) and Q5_0 for Llama
(q/k rows permuted; the quantized layers are served quantized, on the int8/int4 kernels), Q8_0 for Qwen2 (biases, tied embeddings) and Qwen3 (q/k norms, 128-wide heads:
transformers' GGUF config reader takes Qwen3's head_dim from its config default, not from the
file, so the reference is only right for 128). float32 logits of every computed position must
match within 1e-4 and greedy tokens must equal `generate`; the tokenizer comes from the file too.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from splitserve_runtime.gguf_checkpoint import load_gguf_tokenizer
from splitserve_runtime.tiny_model import write_tokenizer
from tests.fixtures.checkpoints import VOCAB_SIZE, CheckpointCache
from tests.fixtures.gguf_files import write_gguf
from tests.fixtures.parity import max_logit_diff, reference_generate, run_recording
from tests.fixtures.ranks import LocalRank
from tests.fixtures.step_driver import StepDriver
from worker_svc.layers.quantized import WeightOnlyLinearMethod
from worker_svc.model_loader.model_load import LoadModelConfig
from worker_svc.worker import Worker

PROMPTS = [[5, 9, 33, 7, 100, 200, 3, 8, 9, 10, 11, 12, 13], [40, 41, 42], list(range(300, 320))]
TOLERANCE = 1e-4
BLOCK_SIZE = 4
FILES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama-F32": ("llama", "F32", {}),
    "llama-Q8_0": ("llama", "Q8_0", {}),
    "llama-Q4_1": ("llama", "Q4_1", {}),
    "llama-Q5_0": ("llama", "Q5_0", {}),
    "qwen2-Q8_0": ("qwen2", "Q8_0", {}),
    "qwen3-Q8_0": ("qwen3", "Q8_0", {"head_dim": 128}),
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gguf-tokenizer")
    write_tokenizer(folder, vocab_size=VOCAB_SIZE)
    return folder


@pytest.fixture(scope="module")
def gguf_files(
    checkpoints: CheckpointCache, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gguf")
    files = {}
    for key, (arch, qtype, options) in FILES.items():
        source = checkpoints.get(arch, **options)
        files[key] = write_gguf(folder / f"tiny-{key}.gguf", source, tokenizer_dir, qtype, arch)
    return files


def transformers_gguf(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def loaded_rank(model: str) -> LocalRank:
    rank = LocalRank()
    rank.load(LoadModelConfig.of(model, block_size=BLOCK_SIZE))
    rank.init(num_blocks=128)
    return rank


@pytest.fixture(params=list(FILES))
def case(request: pytest.FixtureRequest, gguf_files: dict[str, Path]) -> Iterator[tuple[Path, Any]]:
    path = gguf_files[str(request.param)]
    rank = loaded_rank(str(path))
    yield path, rank
    rank.close()


def test_logits_and_greedy_tokens_match_transformers(case: tuple[Path, LocalRank]) -> None:
    path, rank = case
    reference = transformers_gguf(path)
    chunked = StepDriver(BLOCK_SIZE, chunk_size=5)
    handles = [chunked.add(p, max_tokens=6) for p in PROMPTS]
    logits = run_recording(chunked, rank)
    assert max_logit_diff(chunked, logits, reference) < TOLERANCE
    for handle, prompt in zip(handles, PROMPTS, strict=True):
        assert chunked.requests[handle].outputs == reference_generate(reference, prompt, 6)


def test_quantized_weights_are_not_the_float_weights(gguf_files: dict[str, Path]) -> None:
    """The quantized cases really test dequantization: their logits differ from F32's."""
    logits = {}
    for key in ("llama-F32", "llama-Q4_1"):
        with torch.no_grad():
            logits[key] = transformers_gguf(gguf_files[key])(torch.tensor([PROMPTS[0]])).logits
    assert float((logits["llama-F32"] - logits["llama-Q4_1"]).abs().max()) > 1e-2


def quantized_layers(rank: LocalRank) -> int:
    runner = rank.worker.runner
    assert runner is not None
    return sum(
        isinstance(getattr(m, "method", None), WeightOnlyLinearMethod)
        for m in runner.model.modules()
    )


def test_quantized_file_serves_quantized_and_dequantized_on_request(
    gguf_files: dict[str, Path],
) -> None:
    """A Q4_1 file keeps its linear layers quantized (W4A16 on the kernels); with
    --dequantize-gguf it is served in float as before: the two agree within the kernels'
    float32 sums (the weights are the same numbers)."""
    path = gguf_files["llama-Q4_1"]
    results = []
    for dequantize in (False, True):
        rank = LocalRank()
        rank.load(LoadModelConfig.of(str(path), block_size=BLOCK_SIZE, dequantize_gguf=dequantize))
        rank.init(num_blocks=128)
        assert (quantized_layers(rank) > 0) == (not dequantize)
        driver = StepDriver(BLOCK_SIZE)
        for prompt in PROMPTS:
            driver.add(prompt, max_tokens=1)
        results.append(run_recording(driver, rank))
        rank.close()
    for handle, logits in results[0].items():
        assert float((logits - results[1][handle]).abs().max()) < TOLERANCE


def test_tokenizer_and_chat_template_come_from_the_file(
    gguf_files: dict[str, Path], tokenizer_dir: Path
) -> None:
    from transformers import AutoTokenizer

    source = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    from_file = load_gguf_tokenizer(gguf_files["llama-Q4_1"])
    text = "the worker streams a token, then 42 more!"
    assert from_file.encode(text, add_special_tokens=False) == source.encode(
        text, add_special_tokens=False
    )
    assert from_file.decode(from_file.encode(text, add_special_tokens=False)) == text
    assert (from_file.bos_token, from_file.eos_token) == (source.bos_token, source.eos_token)
    messages = [{"role": "user", "content": "hi"}]
    rendered = [
        t.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        for t in (from_file, source)
    ]
    assert rendered[0] == rendered[1]


def test_unsupported_gguf_architecture_is_refused_in_one_line(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(8, 32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError) as err:
        Worker("cpu").load_model(LoadModelConfig.of(str(path)))
    message = str(err.value)
    assert "GGUF architecture 'gemma2'" in message and "llama" in message
    assert "\n" not in message

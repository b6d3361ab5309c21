"""Loading checkpoints into our models: dtypes, shards, TP slices, refusals, rotary scaling."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.fixtures.checkpoints import CheckpointCache, hf_config, load_reference
from tests.fixtures.parity import reference_logits, run_recording
from tests.fixtures.ranks import LocalRank
from tests.fixtures.step_driver import StepDriver
from worker_svc.distributed import ParallelState
from worker_svc.layers.embedding import VocabParallelEmbedding
from worker_svc.layers.linear import ColumnParallelLinear, RowParallelLinear
from worker_svc.layers.rotary import inverse_frequencies
from worker_svc.layers.tensor_source import InMemoryTensor
from worker_svc.model_loader.model_load import LoadModelConfig
from worker_svc.models.model_config import ModelConfig
from worker_svc.models.registry import SUPPORTED_ARCHITECTURES, UnsupportedArchitectureError
from worker_svc.worker import Worker, WorkerStateError

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]
CPU = torch.device("cpu")


def last_logits(path: Path, dtype: str = "auto") -> tuple[torch.Tensor, str]:
    rank = LocalRank()
    loaded = rank.load(LoadModelConfig.of(str(path), dtype=dtype, block_size=4))[0]
    rank.init(num_blocks=16)
    driver = StepDriver(4)
    handle = driver.add(PROMPT, max_tokens=1)
    logits = run_recording(driver, rank)[handle]
    rank.close()
    return logits, loaded.dtype


def test_sharded_checkpoint_loads(worker_checkpoints: CheckpointCache) -> None:
    path = worker_checkpoints.get("llama", max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").exists()
    assert len(list(path.glob("*.safetensors"))) > 1
    logits, _ = last_logits(path)
    ref = reference_logits(load_reference(path), PROMPT)
    assert float((logits - ref).abs().max()) < 1e-4


def test_bf16_checkpoint_runs_in_bf16(worker_checkpoints: CheckpointCache) -> None:
    path = worker_checkpoints.get("qwen2", dtype=torch.bfloat16)
    logits, dtype = last_logits(path)
    assert dtype == "bfloat16"
    ref = reference_logits(load_reference(path, torch.bfloat16), PROMPT)
    assert torch.isfinite(logits).all()
    assert float((logits - ref).abs().max()) < 0.25  # bf16 rounding, two layers
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() > 0.7


def test_fp16_checkpoint_runs_as_float32_on_cpu(worker_checkpoints: CheckpointCache) -> None:
    path = worker_checkpoints.get("mistral", dtype=torch.float16)
    _, dtype = last_logits(path)
    assert dtype == "float32"
    _, forced = last_logits(path, dtype="bfloat16")
    assert forced == "bfloat16"


def test_unknown_architecture_is_refused_with_supported_list(tmp_path: Path) -> None:
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(
        str(tmp_path)
    )
    with pytest.raises(UnsupportedArchitectureError) as info:
        Worker("cpu").load_model(LoadModelConfig.of(str(tmp_path)))
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    assert all(arch in message for arch in SUPPORTED_ARCHITECTURES)
    assert {
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "GraniteForCausalLM",
        "GraniteMoeHybridForCausalLM",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "MixtralForCausalLM",
        "Phi3ForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "LlavaForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen3MoeForCausalLM",
        "Qwen3NextForCausalLM",
        "SmolLM3ForCausalLM",
        "Olmo2ForCausalLM",
        "Glm4ForCausalLM",
        "GptOssForCausalLM",
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
    } == set(SUPPORTED_ARCHITECTURES)


def test_missing_tensor_is_reported(worker_checkpoints: CheckpointCache, tmp_path: Path) -> None:
    source = worker_checkpoints.get("llama")
    tensors = load_file(str(source / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((source / "config.json").read_text())
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.gate_up_proj\.weight"):
        Worker("cpu").load_model(LoadModelConfig.of(str(tmp_path)))


def test_worker_refuses_out_of_order_calls(worker_checkpoints: CheckpointCache) -> None:
    worker = Worker("cpu")
    with pytest.raises(WorkerStateError):
        worker.get_kv_capacity(0.9, 0)
    worker.load_model(LoadModelConfig.of(str(worker_checkpoints.get("llama"))))
    worker.initialize_kv_cache(8)
    assert worker.is_kv_cache_ready
    # A restarted engine core loads again: the rank starts over (KV cache to be re-sized).
    worker.load_model(LoadModelConfig.of(str(worker_checkpoints.get("llama"))))
    assert not worker.is_kv_cache_ready
    capacity = worker.get_kv_capacity(0.9, 0)
    # 2 layers x (K, V) x 16 tokens x 2 KV heads x 16 dims x 4 bytes
    assert capacity.bytes_per_block == 2 * 2 * 16 * 2 * 16 * 4
    # On CPU without a size: room for max_num_seqs (256 by default) x max_model_len tokens, the
    # null block (block 0) counted once (the tiny model is far below half the free memory).
    assert worker.runner is not None
    usable_blocks = 256 * -(-worker.runner.max_model_len // 16) + 1
    assert capacity.num_blocks == usable_blocks
    assert capacity.available_bytes == usable_blocks * capacity.bytes_per_block
    assert worker.get_kv_capacity(0.9, 10 * capacity.bytes_per_block).num_blocks == 10
    assert worker.runner.profile_run(40, 16) == 4 * capacity.bytes_per_block  # 3 + null block
    assert worker.initialize_kv_cache(8) == 8 * capacity.bytes_per_block
    with pytest.raises(WorkerStateError):
        worker.initialize_kv_cache(8)
    worker.shutdown()


def test_llama3_rope_frequencies_match_transformers() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = hf_config("llama3_rope", architectures=["LlamaForCausalLM"])
    ours = inverse_frequencies(16, ModelConfig.from_hf_config(hf).rope)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, CPU)
    assert torch.equal(ours, theirs)
    plain = hf_config("llama", architectures=["LlamaForCausalLM"])
    assert not torch.equal(ours, inverse_frequencies(16, ModelConfig.from_hf_config(plain).rope))


def test_tensor_parallel_slices() -> None:
    rank1 = ParallelState(rank=1, tp_size=2)
    qkv = ColumnParallelLinear(
        4, [4, 2, 2], bias=False, parallel=rank1, dtype=torch.float32, device=CPU
    )
    full = {
        n: torch.arange(s * 4, dtype=torch.float32).view(s, 4) + 100 * i
        for i, (n, s) in enumerate([("q", 4), ("k", 2), ("v", 2)])
    }
    for part, name in enumerate(["q", "k", "v"]):
        qkv.load("weight", InMemoryTensor(full[name]), part)
    assert torch.equal(qkv.weight, torch.cat([full["q"][2:], full["k"][1:], full["v"][1:]]))

    row = RowParallelLinear(4, 3, bias=False, parallel=rank1, dtype=torch.float32, device=CPU)
    weight = torch.arange(12, dtype=torch.float32).view(3, 4)
    row.load("weight", InMemoryTensor(weight))
    assert torch.equal(row.weight, weight[:, 2:])

    embed = VocabParallelEmbedding(100, 2, parallel=rank1, dtype=torch.float32, device=CPU)
    table = torch.arange(200, dtype=torch.float32).view(100, 2)
    embed.load("weight", InMemoryTensor(table))
    assert (embed.vocab_start, embed.num_rows) == (64, 64)  # vocab padded to 128
    assert torch.equal(embed.weight[:36], table[64:]) and not embed.weight[36:].any()

"""`python -m benchmarks.worker_families`: a decode step of each family of issue 41 against a
same-size Llama's, on one worker rank with the CPU kernels (bf16).

Every model has the shape of benchmarks/bench_model.py's ~100M Llama (hidden 768, 12 layers, 12
heads, 4 KV heads of 64, vocab 32000) with its family's own parts, built by transformers from
its config class with random weights (bf16) under the splitserve cache folder: SmolLM3 (every
fourth layer NoPE), OLMo 2 (post-norms, whole-projection q/k norms), GLM-4 (sandwich norms,
GPT-J rotary on half of each head, intermediate 2048), gpt-oss (attention sinks, sliding 128 on
every other layer, 8 experts of 1024 with top-2: the same active MLP width as Llama's 2048),
DeepSeek-V3 (MLA: a 256 + 16 latent per token, heads of 48 + 16; a dense first layer, then 8
experts of 768 with top-2 and one shared: an active width of 2304), and the hybrids, three
state layers to one attention layer: GraniteMoeHybrid (Mamba2: 24 heads of 64, state 128, one
group, conv 4; the dense shared MLP of 2048) and Qwen3-Next (gated DeltaNet: 6 key and 12 value
heads of 64; gated attention with a quarter rotary; 8 experts of 512 with top-2 and a shared
one of 1024: an active width of 2048). A hybrid's requests compute their 256 tokens first (a
state has no prefix hit); the decode steps are timed as for the others.
Reports, as JSON lines, the median decode step (`benchmarks.worker`'s `bench_decode`: batch B
with 256 cached tokens each) and its ratio to Llama's in the same run; the target is 1.3x.
`llama_torch_attention` is the same Llama on the torch attention backend, which models with
sliding windows, soft caps or sinks take on CPU (the cpu backend's kernels have none of them):
what of a family's ratio is that backend's. Medians of 3 rounds (the order reversed every other
round), about 4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.bench_model import BENCH_CONFIG, VOCAB_SIZE
from benchmarks.worker import bench_decode, emit
from benchmarks.worker_steps import BLOCK_SIZE, Session
from splitserve_runtime.model_cache import default_cache_dir
from worker_svc.model_loader.model_load import LoadModelConfig
from worker_svc.worker import Worker

SHAPE = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": BENCH_CONFIG["hidden_size"],
    "intermediate_size": BENCH_CONFIG["intermediate_size"],
    "num_hidden_layers": BENCH_CONFIG["num_hidden_layers"],
    "num_attention_heads": BENCH_CONFIG["num_attention_heads"],
    "num_key_value_heads": BENCH_CONFIG["num_key_value_heads"],
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
}
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "smollm3": ("SmolLM3Config", {}),
    "olmo2": ("Olmo2Config", {}),
    "glm4": ("Glm4Config", {}),
    "gpt_oss": (
        "GptOssConfig",
        {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 1024},
    ),
    "granite_hybrid": (
        "GraniteMoeHybridConfig",
        {
            "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 3,
            "mamba_n_heads": 24,
            "mamba_d_head": 64,
            "mamba_d_state": 128,
            "mamba_n_groups": 1,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_chunk_size": 256,
            "num_local_experts": 0,
            "shared_intermediate_size": BENCH_CONFIG["intermediate_size"],
            "position_embedding_type": "rope",
        },
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        {
            "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 3,
            "partial_rotary_factor": 0.25,
            "linear_num_key_heads": 6,
            "linear_num_value_heads": 12,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "linear_conv_kernel_dim": 4,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 1024,
        },
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        {
            "num_key_value_heads": 12,
            "q_lora_rank": 384,
            "kv_lora_rank": 256,
            "qk_nope_head_dim": 48,
            "qk_rope_head_dim": 16,
            "v_head_dim": 64,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 768,
            "first_k_dense_replace": 1,
            "n_group": 4,
            "topk_group": 2,
        },
    ),
}


def ensure_family_model(family: str) -> Path:
    """The family's same-size bf16 checkpoint, built by transformers on first use."""
    import torch
    import transformers

    folder = default_cache_dir() / f"bench-{family}-100m-bf16"
    if not (folder / "config.json").exists():
        class_name, extra = FAMILIES[family]
        config = getattr(transformers, class_name)(**{**SHAPE, **extra})
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(str(folder))
    return folder


def family_steps(family: str, batch_sizes: Sequence[int], steps: int) -> dict[int, float]:
    """Median decode step (ms) by batch size, 256 cached tokens per request."""
    worker = Worker("cpu")
    model = family.removesuffix("_torch_attention")
    config = LoadModelConfig.of(
        str(ensure_family_model(model)),
        attention_backend="torch" if family != model else "auto",
        dtype="bfloat16",
        max_num_seqs=max(batch_sizes),
        block_size=BLOCK_SIZE,
    )
    worker.load_model(config)
    num_blocks = max(batch_sizes) * (256 + steps + 8) // BLOCK_SIZE + 64
    assert worker.runner is not None
    num_state_slots = max(batch_sizes) + 1 if worker.runner.state_specs else 0
    worker.initialize_kv_cache(num_blocks, num_state_slots)
    assert worker.runner.kv_cache is not None
    worker.runner.kv_cache.zero_blocks(np.arange(num_blocks))
    session = Session(worker, num_blocks, num_state_slots)
    try:
        return {b: bench_decode(session, b, 256, steps)["step_ms"] for b in batch_sizes}
    finally:
        worker.shutdown()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default = ["llama_torch_attention", *list(FAMILIES)[1:]]
    parser.add_argument("--families", nargs="+", default=default)
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3, help="the order reversed every round")
    args = parser.parse_args(argv)
    order = ["llama", *args.families]
    runs: dict[str, list[dict[int, float]]] = {family: [] for family in order}
    for round_index in range(args.rounds):
        for family in order if round_index % 2 == 0 else order[::-1]:
            runs[family].append(family_steps(family, args.batch_sizes, args.steps))
    llama = {b: statistics.median(r[b] for r in runs["llama"]) for b in args.batch_sizes}
    for family in order:
        for b in args.batch_sizes:
            step_ms = statistics.median(r[b] for r in runs[family])
            ratio = step_ms / llama[b]
            record = {"bench": "family_decode", "family": family, "batch_size": b}
            emit(record | {"step_ms": step_ms, "vs_llama": ratio, "target_met": ratio <= 1.3})


if __name__ == "__main__":
    main()

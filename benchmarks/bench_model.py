"""The ~100M-parameter random Llama the benchmarks run on (bf16 checkpoint, 32000-token vocab).

Hidden 768, 12 layers, 12 heads, 4 KV heads, intermediate 2048, vocab 32000: about 100 M
parameters, 200 MB in bf16. Built once (with a tokenizer, so the whole stack can serve it) under
the splitserve cache folder.
"""

from __future__ import annotations

from pathlib import Path

from splitserve_runtime.model_cache import default_cache_dir
from splitserve_runtime.tiny_model import write_random_llama, write_tokenizer

BENCH_CONFIG: dict[str, object] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
VOCAB_SIZE = 32000
BENCH_MODEL_DIRNAME = "bench-llama-100m-bf16"


def ensure_bench_model(folder: Path | None = None) -> Path:
    """The benchmark checkpoint's folder, built on first use."""
    folder = folder or default_cache_dir() / BENCH_MODEL_DIRNAME
    if not (folder / "model.safetensors").exists():
        folder.mkdir(parents=True, exist_ok=True)
        write_tokenizer(folder, vocab_size=VOCAB_SIZE)
        write_random_llama(folder, BENCH_CONFIG, vocab_size=VOCAB_SIZE, seed=0, dtype="bfloat16")
    return folder

"""The scale-out benchmark's model (benchmarks/scaleout.py): the default model's GGUF file as a
bf16 checkpoint both engines can serve, and the KV bytes one token takes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """K and V of every layer for one token (the model's config.json)."""
    config = json.loads((model_dir / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads", heads)
    return int(config["num_hidden_layers"] * 2 * kv_heads * head_dim * DTYPE_BYTES[dtype])


def bf16_checkpoint(gguf_file: Path, out: Path) -> Path:
    """A GGUF checkpoint (the default model's) as a bf16 safetensors folder, dequantized by
    transformers (`from_pretrained(gguf_file=...)`), its tokenizer and chat template beside it,
    so that splitserve and vLLM engines serve the same weights. Made once."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent),
        gguf_file=gguf_file.name,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
    )
    model.save_pretrained(str(out), safe_serialization=True)
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)  # the weights saved are plain bf16
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for extra in gguf_file.parent.iterdir():
        if extra.suffix in (".json", ".jinja") and extra.name != "config.json":
            shutil.copy(extra, out / extra.name)
    return out

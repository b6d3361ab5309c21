"""`--quantization` (vLLM's flag) and `--dequantize-gguf`: the names the engine core accepts and
forwards to the workers, which check them against the checkpoint (worker_svc/quantization)."""

from __future__ import annotations

from splitserve_runtime.flags import Flag, flag, only_values

CHECKPOINT_FORMATS = ("fp8", "compressed-tensors", "awq", "gptq", "gguf")
"""vLLM's names for quantized checkpoints (`quantization_config.quant_method`, or a .gguf)."""
ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq"}
"""vLLM's names for a GPU kernel of a checkpoint format this CPU build serves on its own
kernels (vLLM picks gptq_marlin / awq_marlin for GPTQ / AWQ checkpoints on CUDA; the
checkpoint is the same)."""
ONLINE_METHODS = ("int8", "int4", "w8a8")
"""splitserve's own: a float checkpoint quantized at load (int8: W8A16, int4: W4A16 in groups
of 32, w8a8: int8 weights and per-token int8 activations)."""
QUANTIZATION_CHOICES = (*CHECKPOINT_FORMATS, *ONLINE_METHODS)
"""The names a worker accepts in LoadModelRequest.quantization (besides "")."""
ACCEPTED_FLAG_VALUES = ("auto", *QUANTIZATION_CHOICES, *ALIASES)
NOT_LOADABLE_WHY = (
    "splitserve loads fp8, compressed-tensors, awq, gptq and gguf checkpoints, and int8, int4 "
    "or w8a8 quantize a float checkpoint at load"
)


def canonical_quantization(value: str) -> str:
    """The flag's value as the workers take it: "" for the checkpoint's own ("auto"), an
    alias as the format it names (gptq_marlin: gptq, awq_marlin: awq)."""
    return "" if value == "auto" else ALIASES.get(value, value)


def quantization_flags() -> list[Flag]:
    return [
        flag(
            "--quantization",
            "-q",
            default="auto",
            type=only_values(*ACCEPTED_FLAG_VALUES, why=NOT_LOADABLE_WHY),
            help="the weights' quantization (vLLM's flag; auto: the checkpoint's own). "
            "Checkpoint formats: fp8, compressed-tensors (int W4A16/W8A16/W8A8), awq (GEMM), "
            "gptq (4/8-bit, act-order too), gguf (gptq_marlin, awq_marlin: gptq, awq); a "
            "float checkpoint quantized at load: int8 (int8 weights, per-row scales), int4 "
            "(4-bit weights in groups of 32), w8a8 (int8 weights and activations); the CPU "
            "kernels run them",
        ),
        flag(
            "--dequantize-gguf",
            action="store_true",
            help="serve a GGUF file's quantized weights dequantized to float at load (the "
            "default keeps Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K weights quantized)",
        ),
    ]


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
"""vLLM's --kv-cache-dtype values splitserve stores: auto (the model's dtype), fp8 (= fp8_e4m3,
vLLM's meaning), fp8_e4m3 and fp8_e5m2 (one byte per value, per-tensor scales)."""
KV_CACHE_DTYPES_WHY = (
    "the KV cache is stored as auto (the model's dtype), fp8 / fp8_e4m3 or fp8_e5m2; "
    "vLLM's other cache dtypes (bfloat16, fp8_inc, fp8_ds_mla, ...) are not"
)


def kv_cache_dtype_flag() -> Flag:
    return flag(
        "--kv-cache-dtype",
        default="auto",
        type=only_values(*KV_CACHE_DTYPES, why=KV_CACHE_DTYPES_WHY),
        help="KV-cache dtype (vLLM's flag): auto (the model's dtype), or fp8 (= fp8_e4m3) / "
        "fp8_e5m2: one byte per value, twice the blocks in the same memory; values are stored "
        "divided by the layer's k_scale / v_scale (the checkpoint's, else 1.0, as vLLM)",
    )

"""`--quantization` (vLLM's flag) and `--dequantize-gguf`: the names the engine core accepts and
forwards to the workers, which check them against the checkpoint (worker_svc/quantization)."""

from __future__ import annotations

from splitserve_runtime.flags import Flag, flag

CHECKPOINT_FORMATS = ("fp8", "compressed-tensors", "awq", "gptq", "gguf")
"""vLLM's names for quantized checkpoints (`quantization_config.quant_method`, or a .gguf)."""
NOT_YET_LOADABLE = ("compressed-tensors", "awq", "gptq")
"""Checkpoint formats splitserve does not load yet (refused by name)."""
ONLINE_METHODS = ("int8", "int4", "w8a8")
"""splitserve's own: a float checkpoint quantized at load (int8: W8A16, int4: W4A16 in groups
of 128, w8a8: int8 weights and per-token int8 activations)."""
QUANTIZATION_CHOICES = (*CHECKPOINT_FORMATS, *ONLINE_METHODS)


def quantization_flags() -> list[Flag]:
    return [
        flag(
            "--quantization",
            "-q",
            default="",
            choices=QUANTIZATION_CHOICES,
            help="the weights' quantization (vLLM's flag; default: the checkpoint's own). "
            "Checkpoint formats: fp8, gguf (compressed-tensors, awq and gptq are not loaded "
            "yet); a float checkpoint quantized at load: int8 (int8 weights, per-row scales), "
            "int4 (4-bit weights in groups of 128), w8a8 (int8 weights and activations); the "
            "CPU kernels run them",
        ),
        flag(
            "--dequantize-gguf",
            action="store_true",
            help="serve a GGUF file's quantized weights dequantized to float at load (the "
            "default keeps Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K weights quantized)",
        ),
    ]

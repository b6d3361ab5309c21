"""The quantization registry's rows, and `--quantization` (vLLM's flag) and `--dequantize-gguf`.

One row per name `--quantization` takes (vLLM's `QUANTIZATION_METHODS`): what the format is read
from, the worker's `QuantizationConfig` class for it ("module:Class", imported only by the
worker: worker_svc/quantization/config.py `get_quantization_config`) and vLLM's other names for
it. This module imports no torch, so the engine core (the flag's choices, `canonical_quantization`)
and the workers (the checks against the checkpoint) read the same table; every list of names is
derived from it. A format is its file under worker_svc/quantization plus one row here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from splitserve_runtime.flags import Flag, flag, only_values

Reads = Literal["checkpoint", "gguf-file", "float"]
"""Where a format's weights come from: a checkpoint whose config.json `quantization_config`
names it (`quant_method`), a .gguf file, or a float checkpoint quantized at load (online)."""


@dataclass(frozen=True, slots=True)
class QuantizationFormat:
    """One registry row: vLLM's name, what it reads, the worker's config class, vLLM's other
    names for it (GPU kernels of the same checkpoint: the CPU kernels here serve it) and what
    `--help` says of it."""

    name: str
    reads: Reads
    config_class: str
    help: str
    aliases: tuple[str, ...] = ()

    @property
    def is_online(self) -> bool:
        return self.reads == "float"


_Q = "worker_svc.quantization"
FORMATS: tuple[QuantizationFormat, ...] = (
    QuantizationFormat("fp8", "checkpoint", f"{_Q}.fp8:Fp8Config", "fp8"),
    QuantizationFormat(
        "compressed-tensors",
        "checkpoint",
        f"{_Q}.compressed_tensors:CompressedTensorsConfig",
        "compressed-tensors (int W4A16/W8A16/W8A8)",
    ),
    QuantizationFormat("awq", "checkpoint", f"{_Q}.awq:AwqConfig", "awq (GEMM)", ("awq_marlin",)),
    QuantizationFormat(
        "gptq",
        "checkpoint",
        f"{_Q}.gptq:GptqConfig",
        "gptq (4/8-bit, act-order too)",
        ("gptq_marlin",),
    ),
    QuantizationFormat("gguf", "gguf-file", f"{_Q}.gguf:GgufConfig", "gguf"),
    QuantizationFormat(
        "mxfp4", "checkpoint", f"{_Q}.mxfp4:Mxfp4Config", "mxfp4 (gpt-oss experts, dequantized)"
    ),
    QuantizationFormat(
        "int8", "float", f"{_Q}.online:Int8Config", "int8 (int8 weights, per-row scales)"
    ),
    QuantizationFormat(
        "int4", "float", f"{_Q}.online:Int4Config", "int4 (4-bit weights in groups of 32)"
    ),
    QuantizationFormat(
        "w8a8", "float", f"{_Q}.online:W8a8Config", "w8a8 (int8 weights and activations)"
    ),
)
"""The registry (vLLM's names; int8, int4 and w8a8 are splitserve's own online methods)."""

_BY_NAME = {f.name: f for f in FORMATS} | {a: f for f in FORMATS for a in f.aliases}
QUANTIZATION_CHOICES = tuple(f.name for f in FORMATS)
"""The names a worker accepts in LoadModelRequest.quantization (besides "")."""
ONLINE_METHODS = tuple(f.name for f in FORMATS if f.is_online)
CONFIG_FORMATS = tuple(f.name for f in FORMATS if f.reads == "checkpoint")
"""The `quant_method`s of a config.json `quantization_config` the workers read."""
ACCEPTED_FLAG_VALUES = ("auto", *_BY_NAME)


def spoken(names: tuple[str, ...], last: str = "and") -> str:
    """("a", "b", "c") -> "a, b and c"."""
    return f"{', '.join(names[:-1])} {last} {names[-1]}" if len(names) > 1 else "".join(names)


NOT_LOADABLE_WHY = (
    f"splitserve loads {spoken(tuple(f.name for f in FORMATS if not f.is_online))} checkpoints, "
    f"and {spoken(ONLINE_METHODS, 'or')} quantize a float checkpoint at load"
)


def quantization_format(name: str) -> QuantizationFormat:
    """The row of `name` (or of one of its aliases); ValueError naming the known ones."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(
            f"unknown quantization method {name!r}: must be one of {', '.join(_BY_NAME)}"
        ) from None


def is_online(name: str) -> bool:
    """Whether `name` quantizes a float checkpoint at load ("" and unknown names: no)."""
    row = _BY_NAME.get(name)
    return row is not None and row.is_online


def canonical_quantization(value: str) -> str:
    """The flag's value as the workers take it: "" for the checkpoint's own ("auto"), an
    alias as the format it names (gptq_marlin: gptq, awq_marlin: awq)."""
    if value == "auto":
        return ""
    row = _BY_NAME.get(value)
    return value if row is None else row.name


def _quantization_help() -> str:
    stored = ", ".join(f.help for f in FORMATS if not f.is_online)
    online = ", ".join(f.help for f in FORMATS if f.is_online)
    aliases = ", ".join(f"{a}: {f.name}" for f in FORMATS for a in f.aliases)
    return (
        "the weights' quantization (vLLM's flag; auto: the checkpoint's own). Checkpoint "
        f"formats: {stored} ({aliases}); a float checkpoint quantized at load: {online}; the "
        "CPU kernels run them"
    )


def quantization_flags() -> list[Flag]:
    return [
        flag(
            "--quantization",
            "-q",
            default="auto",
            type=only_values(*ACCEPTED_FLAG_VALUES, why=NOT_LOADABLE_WHY),
            help=_quantization_help(),
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

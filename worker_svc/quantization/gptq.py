"""GPTQ checkpoints (`quantization_config.quant_method: gptq`, as GPTQModel and AutoGPTQ write
them and vLLM's GPTQConfig reads them), served as W4A16 / W8A16 on the int4/int8 kernels.

Each layer stores `qweight` int32 [in x bits / 32, out] (the values of 32 / bits consecutive
input features per word, lowest bits first), `qzeros` int32 [groups, out x bits / 32] (the same
packing along the output features), `scales` float16 [groups, out] and `g_idx` int32 [in], the
group of every input feature; w[n, k] = scales[g, n] (q[k, n] - zero[g, n]) with g = g_idx[k].

- Zero points: `checkpoint_format` "gptq" (v1, the default) stores zero - 1, subtracted from the
  whole packed word (GPTQModel's `convert_gptq_v2_to_v1_format`); the reader adds it back to the
  whole word, which is its exact inverse also where a zero point of 0 borrowed from its
  neighbour (asymmetric checkpoints). "gptq_v2" stores the zero points as they are.
- Act-order (`desc_act`): the groups follow `g_idx`, not the column order. A layer whose g_idx
  is not k // group_size keeps it (`GroupQuantized.g_idx`): the packing sorts its columns by
  group (as exllama and Marlin do with argsort(g_idx)) and the kernels gather the activations
  in that order. vLLM ignores g_idx when desc_act is false; the reader always follows it, as
  GPTQModel's own dequantization does.
- A layer becomes `GroupQuantized` exactly: values q, scale, offset = -zero x scale (a float16
  times an integer below 2^8 + 1 is exact in float32).

The unpacking is written here (shifts and masks, as the AWQ reader's): GPTQModel's own
dequantization lives on its QuantLinear modules, which import its whole quantization stack;
tests/unit/worker/test_gptq_reader.py checks this reader bit for bit against GPTQModel's
`dequantize_weight` on layers packed by GPTQModel's own `pack`.
Refused in one line: 2/3-bit and other widths, other checkpoint formats (gptq_p, marlin,
bitblas), a quantized lm_head, per-module overrides (`dynamic`), pack dtypes other than int32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from worker_svc.layers.quant_pack import GroupQuantized, from_zero_points
from worker_svc.layers.quant_source import ConvertedTensor
from worker_svc.layers.tensor_source import TensorSource
from worker_svc.quantization.config import PackedConfig

PARTS = ("qweight", "qzeros", "scales", "g_idx")
FORMATS = ("gptq", "gptq_v2")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
WORD = 0xFFFFFFFF
V1_ZERO_OFFSETS = {4: 0x11111111, 8: 0x01010101}
"""What a v1 checkpoint subtracted from every qzeros word (1 from each packed zero point)."""


@dataclass(frozen=True, slots=True)
class GptqScheme:
    """bits, group size (-1: one group per row), whether zero points are stored as is, and
    act-order (every layer then needs its g_idx)."""

    bits: int
    group_size: int
    is_v2: bool
    desc_act: bool = False


def _unsupported(quantization: dict[str, Any], bits: object, fmt: str) -> str | None:
    group_size = quantization.get("group_size", 128)
    if bits not in (4, 8):
        return f"{bits}-bit weights (4 and 8 are)"
    if fmt not in FORMATS:
        return f"checkpoint_format {fmt!r} (gptq and gptq_v2 are)"
    if quantization.get("is_marlin_format"):
        return "is_marlin_format (the Marlin-repacked layout)"
    if quantization.get("lm_head"):
        return "a quantized lm_head (lm_head: true)"
    if quantization.get("dynamic"):
        return "per-module overrides (dynamic)"
    if str(quantization.get("pack_dtype", "int32")) != "int32":
        return f"pack_dtype {quantization.get('pack_dtype')!r} (int32 is)"
    if not isinstance(group_size, int) or (group_size < 1 and group_size != -1):
        return f"group_size {group_size!r}"
    return None


def check_config(quantization: dict[str, Any]) -> GptqScheme:
    """The scheme of a loadable GPTQ configuration; ValueError naming what is not."""
    bits = quantization.get("bits", quantization.get("w_bit"))
    fmt = quantization.get("checkpoint_format") or quantization.get("format") or "gptq"
    fmt = str(getattr(fmt, "value", fmt)).lower()
    what = _unsupported(quantization, bits, fmt)
    if what is not None:
        raise ValueError(f"quantization method 'gptq': {what} is not supported")
    assert isinstance(bits, int)  # 4 or 8: checked above
    group_size = int(quantization.get("group_size", 128))
    return GptqScheme(bits, group_size, fmt == "gptq_v2", bool(quantization.get("desc_act")))


def unpack_columns(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 (or int64) words [rows, n] -> uint8 [rows, n x 32 / bits], each word's values
    lowest bits first."""
    per_word = 32 // bits
    values = torch.empty(words.shape[0], words.shape[1] * per_word, dtype=torch.uint8)
    for j in range(per_word):
        values[:, j::per_word] = ((words >> (bits * j)) & ((1 << bits) - 1)).to(torch.uint8)
    return values


def unpack_zeros(qzeros: torch.Tensor, bits: int, is_v2: bool) -> torch.Tensor:
    """qzeros int32 [groups, out x bits / 32] -> the zero points, uint8 [groups, out]."""
    words = qzeros.long() & WORD
    if not is_v2:
        words = (words + V1_ZERO_OFFSETS[bits]) & WORD
    return unpack_columns(words, bits)


def check_parts(parts: dict[str, torch.Tensor]) -> None:
    """Refuse a layer's tensors of the wrong type or rank, naming the tensor."""
    expected: dict[str, tuple[int, tuple[torch.dtype, ...]]] = {
        "qweight": (2, (torch.int32,)),
        "qzeros": (2, (torch.int32,)),
        "g_idx": (1, (torch.int32, torch.int64)),
        "scales": (2, FLOAT_DTYPES),
    }
    for name, (num_dims, dtypes) in expected.items():
        t = parts.get(name)
        if t is not None and (t.dtype not in dtypes or t.dim() != num_dims):
            raise ValueError(
                f"GPTQ {name} must be a {num_dims}-D {dtypes[0]} tensor, got {t.dtype} "
                f"{tuple(t.shape)}"
            )


def to_group_quantized(parts: dict[str, torch.Tensor], scheme: GptqScheme) -> GroupQuantized:
    """One layer's checkpoint tensors (local names) as the weight the kernels take."""
    check_parts(parts)
    bits = scheme.bits
    scales = parts["scales"]
    num_groups, num_out = scales.shape
    num_in = parts["qweight"].shape[0] * 32 // bits
    g_idx = parts.get("g_idx")
    if g_idx is not None:
        num_in = int(g_idx.numel())
    elif scheme.desc_act:
        raise ValueError("GPTQ desc_act checkpoint without g_idx: its column groups are unknown")
    group_size = num_in if scheme.group_size == -1 else scheme.group_size
    contiguous = torch.arange(num_in, dtype=torch.int64) // group_size
    if g_idx is not None and torch.equal(g_idx.long(), contiguous):
        g_idx = None
    values = unpack_columns(parts["qweight"].t(), bits)[:, :num_in]  # [out, in]
    zeros = unpack_zeros(parts["qzeros"], bits, scheme.is_v2)[:, :num_out].t()
    if values.shape[0] != num_out or zeros.shape[1] != num_groups:
        raise ValueError(
            f"GPTQ tensors disagree: qweight {tuple(parts['qweight'].shape)}, qzeros "
            f"{tuple(parts['qzeros'].shape)}, scales {tuple(scales.shape)}"
        )
    return from_zero_points(
        values.contiguous(),
        scales.t().float(),
        zeros.float(),
        bits,
        group_size,
        None if g_idx is None else g_idx.to(torch.int64).contiguous(),
    )


def make_source(parts: dict[str, TensorSource], scheme: GptqScheme) -> ConvertedTensor:
    """A layer's GPTQ tensors as one quantized source, shaped [out, in]."""
    num_words, num_out = parts["qweight"].get_shape()
    num_in = num_words * 32 // scheme.bits
    if "g_idx" in parts:
        num_in = parts["g_idx"].get_shape()[0]
    return ConvertedTensor(parts, lambda t: to_group_quantized(t, scheme), [num_out, num_in])


class GptqConfig(PackedConfig[GptqScheme]):
    """vLLM's GPTQConfig: the registry's `gptq` (and `gptq_marlin`); AutoGPTQ's
    quantize_config.json is read when config.json has no quantization_config."""

    layer_tensors = PARTS
    marker = "qweight"

    parse_scheme = staticmethod(check_config)

    @classmethod
    def get_config_filenames(cls) -> tuple[str, ...]:
        return ("quantize_config.json",)

    def make_source(self, layer: dict[str, TensorSource]) -> TensorSource:
        return make_source(layer, self.scheme)

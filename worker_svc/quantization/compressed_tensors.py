"""compressed-tensors checkpoints (`quantization_config.quant_method: compressed-tensors`, as
llm-compressor writes them and vLLM's CompressedTensorsConfig reads them), served on the
int8/int4 kernels:

    format           weights                                     served as
    pack-quantized   int4 (or int8) packed in int32 words           W4A16 / W8A16
                     (`weight_packed`, `weight_shape`), group or
                     channel scales, zero points if asymmetric
    int-quantized    int8 `weight`, channel (or group) scales       W8A16, or W8A8 when the
                                                                    input activations are
                                                                    dynamic per-token int8

The packed words are unpacked by the library's own `unpack_from_int32`; a weight becomes
`GroupQuantized` exactly: w = scale (q - zero point) = scale u + offset with u = q + 2^(bits-1)
(4 bits: 0..15) and offset = -scale (2^(bits-1) + zero point) (exact in float32: a float16 or
bfloat16 scale times an integer of at most 9 bits). Refused in one line: other formats
(float8, nvfp4, marlin-24, sparse), other bit widths, act-order (`actorder`), static or
non-token activation scales, asymmetric W8A8."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from worker_svc.layers.quant_pack import GroupQuantized
from worker_svc.layers.quant_source import ConvertedTensor
from worker_svc.layers.tensor_source import TensorSource
from worker_svc.quantization.config import PackedConfig

FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
PARTS = ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point")
Weights = Iterator[tuple[str, TensorSource]]


@dataclass(frozen=True, slots=True)
class CtScheme:
    """What the checkpoint's one config group says: bits, group size (0: one per row),
    symmetric, packed, and whether activations are quantized per token (W8A8)."""

    bits: int
    group_size: int
    is_symmetric: bool
    is_packed: bool
    is_w8a8: bool


def _refuse(what: str) -> ValueError:
    return ValueError(f"quantization method 'compressed-tensors': {what} is not supported")


def _weights_args(group: dict[str, Any]) -> tuple[int, int, bool]:
    args = group.get("weights") or {}
    if args.get("type", "int") != "int" or args.get("num_bits") not in (4, 8):
        raise _refuse(f"{args.get('type', 'int')} weights of {args.get('num_bits')} bits")
    if args.get("actorder") not in (None, False):
        raise _refuse(f"actorder {args.get('actorder')!r}")
    strategy = args.get("strategy")
    if strategy not in ("group", "channel"):
        raise _refuse(f"weight strategy {strategy!r}")
    group_size = int(args.get("group_size") or 0) if strategy == "group" else 0
    return int(args["num_bits"]), group_size, bool(args.get("symmetric", True))


def parse_scheme(quantization: dict[str, Any]) -> CtScheme:
    fmt = quantization.get("format")
    if fmt not in FORMATS:
        raise _refuse(f"format {fmt!r} (splitserve loads {', '.join(FORMATS)})")
    groups = list((quantization.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise _refuse(f"{len(groups)} config groups (one is)")
    bits, group_size, is_symmetric = _weights_args(groups[0])
    acts = groups[0].get("input_activations")
    is_w8a8 = acts is not None
    if is_w8a8:
        expected = acts.get("num_bits") == 8 and acts.get("type", "int") == "int"
        if not (expected and acts.get("dynamic") and acts.get("strategy") == "token"):
            raise _refuse("input activations other than dynamic per-token int8")
        if bits != 8 or group_size or not is_symmetric:
            raise _refuse("W8A8 with other than symmetric per-channel int8 weights")
    if bits == 4 and fmt != "pack-quantized":
        raise _refuse(f"4-bit weights in format {fmt!r}")
    return CtScheme(bits, group_size, is_symmetric, fmt == "pack-quantized", is_w8a8)


def to_group_quantized(parts: dict[str, torch.Tensor], scheme: CtScheme) -> GroupQuantized:
    """One layer's checkpoint tensors (local names) as the weight the kernels take."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    scale = parts["weight_scale"].float()
    if scheme.is_packed:
        shape = torch.Size(int(v) for v in parts["weight_shape"].tolist())
        q = unpack_from_int32(parts["weight_packed"], scheme.bits, shape)
    else:
        q = parts["weight"]
    num_rows, num_cols = q.shape
    zero = torch.zeros_like(scale)
    if not scheme.is_symmetric:
        zp = parts["weight_zero_point"]
        if scheme.is_packed:
            zp = unpack_from_int32(zp, scheme.bits, torch.Size(scale.shape), packed_dim=0)
        zero = zp.float().reshape(scale.shape)
    group_size = scheme.group_size or num_cols
    if scheme.bits == 4:
        offset = 8.0
        values = (q.to(torch.int16) + 8).to(torch.uint8)
    else:
        offset = 0.0
        values = q.to(torch.int8)
    offsets = -scale * (zero + offset)
    is_plain = scheme.bits == 8 and scheme.is_symmetric
    return GroupQuantized(
        values.reshape(num_rows, num_cols),
        scale.reshape(num_rows, -1),
        None if is_plain else offsets.reshape(num_rows, -1),
        scheme.bits,
        group_size,
    )


class CtQuantizedTensor(ConvertedTensor):
    """A layer's compressed tensors (a `QuantizedSource`), read and converted when a layer
    first asks; float32 slices for a reader that wants floats. Its shape too is read when
    asked (`weight_shape`, or the unpacked `weight`'s)."""

    def __init__(self, parts: dict[str, TensorSource], scheme: CtScheme) -> None:
        convert = partial(to_group_quantized, scheme=scheme)
        super().__init__(parts, convert, [])  # no shape: get_shape reads it when asked
        self.scheme = scheme

    def get_shape(self) -> list[int]:
        if "weight_shape" in self.parts:
            return [int(v) for v in self.parts["weight_shape"][:].tolist()]
        return self.parts["weight"].get_shape()


class CompressedTensorsConfig(PackedConfig[CtScheme]):
    """vLLM's CompressedTensorsConfig: the registry's `compressed-tensors`."""

    layer_tensors = (*PARTS, "weight")
    marker = "weight_scale"

    parse_scheme = staticmethod(parse_scheme)

    @property
    def is_w8a8(self) -> bool:
        return self.scheme.is_w8a8

    def make_source(self, layer: dict[str, TensorSource]) -> TensorSource:
        return CtQuantizedTensor(layer, self.scheme)


def layer_parts(names: list[str], local_names: tuple[str, ...], marker: str) -> dict[str, str]:
    """Checkpoint tensor name -> the `.weight` name of its layer, for the tensors named
    `local_names` of every layer that has a `marker` tensor."""
    present = set(names)
    found: dict[str, str] = {}
    for name in names:
        prefix, _, local = name.rpartition(".")
        if local in local_names and f"{prefix}.{marker}" in present:
            found[name] = prefix + ".weight"
    return found


def group_layers(
    weights: Weights, parts: dict[str, str], make: Callable[[dict[str, TensorSource]], Any]
) -> Weights:
    """The checkpoint's tensors with each quantized layer's parts as one `.weight` source
    (`make(parts by local name)`), yielded once all its parts have been seen."""
    pending: dict[str, dict[str, TensorSource]] = {}
    expected: dict[str, int] = {}
    for layer_name in parts.values():
        expected[layer_name] = expected.get(layer_name, 0) + 1
    for name, source in weights:
        target = parts.get(name)
        if target is None:
            yield name, source
            continue
        layer = pending.setdefault(target, {})
        layer[name.rpartition(".")[2]] = source
        if len(layer) == expected[target]:
            yield target, make(pending.pop(target))
    if pending:
        raise ValueError(f"quantized checkpoint: {sorted(pending)[0]} lacks some of its tensors")

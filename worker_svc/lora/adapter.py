"""One LoRA adapter read from its PEFT folder into this rank's shard, in the layout of the
model's LoRA slots (layers/lora.py): per wrapped layer an (A, B) pair, A [in, R] and B [R, out],
sharded like the base weights, padded to max_lora_rank, scaling folded into B.

A tensor is placed by the base weight it adapts: `base_model.model.<module>.lora_A.weight`
adapts checkpoint tensor `<module>.weight`, which the model resolves (`resolve_weight_name`,
`target_path`) to one of its layers and, for fused layers, a part (an adapter of q_proj lands in
qkv_proj's q columns, as vLLM's packed_modules_mapping says). The safetensors header is checked
against the file's size first (lora/safetensors_header.py: a damaged file is the client's
error), and every name and shape before a tensor is read; anything that is not a LoRA weight of a wrapped layer (embeddings, the
LM head, MoE experts) refuses the adapter in one line.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open

from worker_svc.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear
from worker_svc.layers.lora import LayerWeights, LoraLinearMethod, LoraShape, num_lora_parts
from worker_svc.lora.peft_config import (
    WEIGHTS_FILE,
    AdapterError,
    adapter_folder,
    read_peft_config,
)
from worker_svc.lora.safetensors_header import check_safetensors_header
from worker_svc.models.interfaces import CausalLM
from worker_svc.models.weight_names import WeightTarget

_KEY = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$")
_OTHER_KEY = re.compile(r"^base_model\.model\.(.+?)\.(?:lora_\w+|base_layer|weight|bias)\b")
SUPPORTED_TARGETS = (
    "the attention and MLP projections (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
    "down_proj, and fused qkv_proj / gate_up_proj)"
)


@dataclass(slots=True)
class LoraAdapter:
    """An adapter's weights on this rank, by the LoRA layer they go to: (A [R, in], B [R, out],
    its largest rank there)."""

    lora_id: int
    path: str
    max_rank: int
    target_modules: tuple[str, ...]
    weights: dict[LoraLinearMethod, LayerWeights]
    load_seconds: float

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b, _ in self.weights.values())


@dataclass(frozen=True, slots=True)
class _Placement:
    """Where one adapter tensor pair goes: a LoRA layer and, for fused layers, the part."""

    layer: LinearBase
    method: LoraLinearMethod
    target: WeightTarget


def read_adapter(
    model: CausalLM, lora_id: int, lora_path: str, shape: LoraShape, dtype: torch.dtype
) -> LoraAdapter:
    """Read and shard adapter `lora_path` for this rank of `model` (AdapterError: why not)."""
    started = time.perf_counter()
    folder = adapter_folder(lora_path)
    config = read_peft_config(folder, shape.max_rank)
    staged: dict[LoraLinearMethod, LayerWeights] = {}
    modules: set[str] = set()
    weights_file = folder / WEIGHTS_FILE
    try:
        check_safetensors_header(weights_file)
        with safe_open(str(weights_file), framework="pt", device="cpu") as f:
            for module, placements, keys in _plan(model, list(f.keys()), f):
                a, b = (f.get_tensor(k).to(torch.float32) for k in keys)
                rank, scaling = config.rank_and_scaling(module)
                _check_rank(module, a, b, rank)
                for place in placements:
                    _stage(staged, place, a, b * scaling, shape.max_rank)
                modules.add(module.rsplit(".", 1)[-1])
    except (OSError, RuntimeError, SafetensorError) as err:  # a damaged safetensors file
        raise AdapterError(f"{WEIGHTS_FILE} cannot be read: {err}") from None
    if not modules:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA weights")
    weights = {m: (a.to(dtype), b.to(dtype), rank) for m, (a, b, rank) in staged.items()}
    return LoraAdapter(
        lora_id,
        lora_path,
        config.max_rank,
        tuple(sorted(modules)),
        weights,
        time.perf_counter() - started,
    )


def _plan(
    model: CausalLM, keys: list[str], f: object
) -> Iterator[tuple[str, list[_Placement], tuple[str, str]]]:
    """Per adapted module: where its pair goes on this rank and its (A, B) tensor names; every
    name and shape is checked before any tensor is read."""
    pairs: dict[str, dict[str, str]] = {}
    for key in keys:
        match = _KEY.match(key)
        if match is None:
            other = _OTHER_KEY.match(key)
            raise AdapterError(
                f"LoRA on {other.group(1) if other else key} is not supported ({key!r} is not "
                f"a LoRA A or B weight of a linear layer): adapters may target {SUPPORTED_TARGETS}"
            )
        pairs.setdefault(match.group(1), {})[match.group(2)] = key
    plans = []
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{module} has lora_{'A' if 'B' in pair else 'B'} but no pair")
        placements = _placements(model, module)
        a_shape = f.get_slice(pair["A"]).get_shape()  # type: ignore[attr-defined]
        b_shape = f.get_slice(pair["B"]).get_shape()  # type: ignore[attr-defined]
        for place in placements:
            _check_shapes(module, place, a_shape, b_shape)
        plans.append((module, placements, (pair["A"], pair["B"])))
    yield from plans


def _placements(model: CausalLM, module: str) -> list[_Placement]:
    """Where `module`'s adapter goes on this rank (empty: another pipeline stage holds it)."""
    unsupported = AdapterError(
        f"LoRA on {module} is not supported: adapters may target {SUPPORTED_TARGETS}"
    )
    try:
        targets = model.resolve_weight_name(f"{module}.weight")
    except ValueError:
        raise unsupported from None
    placements = []
    for target in targets:
        path = model.target_path(target)
        if path is None:
            continue
        try:
            layer = model.get_submodule(path)
        except AttributeError:
            raise unsupported from None
        if not isinstance(layer, LinearBase) or not isinstance(layer.method, LoraLinearMethod):
            raise unsupported
        placements.append(_Placement(layer, layer.method, target))
    if not targets:
        raise unsupported
    return placements


def _check_shapes(module: str, place: _Placement, a_shape: list[int], b_shape: list[int]) -> None:
    layer, target = place.layer, place.target
    num_inputs = layer.input_size_per_rank
    if isinstance(layer, RowParallelLinear):
        num_inputs *= layer.parallel.tp_size
        num_outputs = layer.output_size_per_rank
    else:
        assert isinstance(layer, ColumnParallelLinear)
        num_outputs = layer.output_sizes[target.part]
    if target.rows is not None:  # a fused checkpoint tensor: its B holds every part's rows
        num_outputs = b_shape[0] if len(b_shape) == 2 else -1
        if target.rows[0] + target.rows[1] > num_outputs:
            num_outputs = -1
    if (
        len(a_shape) != 2
        or len(b_shape) != 2
        or a_shape[1] != num_inputs
        or b_shape[0] != num_outputs
        or a_shape[0] != b_shape[1]
    ):
        raise AdapterError(
            f"{module}: lora_A {list(a_shape)} and lora_B {list(b_shape)} do not fit the "
            f"model's projection ({num_inputs} inputs): the adapter was trained for another "
            "model"
        )


def _check_rank(module: str, a: torch.Tensor, b: torch.Tensor, rank: int) -> None:
    if a.shape[0] != rank:
        raise AdapterError(
            f"{module}: rank {a.shape[0]} in the weights, {rank} in adapter_config.json"
        )
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise AdapterError(f"{module}: the weights hold NaN or infinite values")


def _stage(
    staged: dict[LoraLinearMethod, LayerWeights],
    place: _Placement,
    a: torch.Tensor,
    b: torch.Tensor,
    max_rank: int,
) -> None:
    """Write this rank's shard of one pair into the layer's (A [R, in], B [R, out]) staging."""
    layer, target = place.layer, place.target
    rank = a.shape[0]
    if place.method not in staged:
        width = num_lora_parts(layer) * max_rank
        staged[place.method] = (
            torch.zeros(width, layer.input_size_per_rank),
            torch.zeros(width, layer.output_size_per_rank),
            rank,
        )
    stage_a, stage_b, layer_rank = staged[place.method]
    staged[place.method] = (stage_a, stage_b, max(layer_rank, rank))
    if target.rows is not None:
        b = b[target.rows[0] : target.rows[0] + target.rows[1]]
    if isinstance(layer, RowParallelLinear):
        size = layer.input_size_per_rank
        start = layer.parallel.tp_rank * size
        stage_a[:rank] = a[:, start : start + size]
        stage_b[:rank] = b.T
        return
    assert isinstance(layer, ColumnParallelLinear)
    part, col = target.part, target.part * max_rank
    start, size = layer.part_starts[part], layer.part_sizes[part]
    offset = layer.part_offsets[part]
    stage_a[col : col + rank] = a
    stage_b[col : col + rank, offset : offset + size] = b[start : start + size].T

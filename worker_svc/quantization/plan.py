"""`--quantization` checked against the checkpoint, and the plan that follows: which linear
layers (and vocabulary tables) of a model hold quantized weights, and how the checkpoint's
tensors are read for them.

    requested   checkpoint            served
    ""          float                 float
    ""/fp8      fp8                   FP8 (kept FP8 on CUDA with FP8 matmuls, else dequantized)
    ""/gguf     .gguf                 Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K weights quantized
                                      (W8A16 / W4A16); --dequantize-gguf: float (today's path)
    ""/compressed-tensors, awq, gptq (gptq_marlin: gptq)
                checkpoint of that    packed int4/int8 weights kept quantized (W4A16/W8A16,
                format                or W8A8 for compressed-tensors int8 activations)
    int8|int4|  float                 quantized at load (worker_svc/quantization/online.py)
    w8a8
    anything else: refused in one line that says why (a name that does not match the
    checkpoint, a checkpoint format asked of a float checkpoint, online quantization of a
    quantized checkpoint).

The plan is made on the model built on the meta device (nothing allocated): each checkpoint
tensor's destinations give the layers it feeds; a fused layer is quantized only when all its
parts are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from splitserve_runtime.quantization_names import (
    canonical_quantization,
    is_online,
    quantization_format,
)
from worker_svc.layers.linear import LinearBase, LinearMethods
from worker_svc.layers.quantized import CUDA_REFUSAL, QuantizedLinearMethods
from worker_svc.layers.tensor_source import TensorSource
from worker_svc.models.interfaces import CausalLM
from worker_svc.quantization.config import QuantizationConfig, get_quantization_config
from worker_svc.quantization.online import INT8_PER_ROW, OnlineConfig, OnlineQuantized

logger = logging.getLogger(__name__)

Weights = Iterator[tuple[str, TensorSource]]
VOCAB = ("embed_tokens", "lm_head")


def resolve_quantization(requested: str, checkpoint_method: str | None, what: str) -> str | None:
    """The quantization to serve `what` (a checkpoint quantized with `checkpoint_method`, None:
    float) with, when `--quantization` is `requested` ("": the checkpoint's); ValueError when
    they do not go together (vLLM's checks: a name no registry row has, a mismatch)."""
    requested = canonical_quantization(requested)
    if checkpoint_method is not None and requested not in ("", checkpoint_method):
        if quantization_format(requested).is_online:
            raise ValueError(
                f"--quantization {requested} quantizes a float checkpoint, but {what} is "
                f"already quantized ({checkpoint_method}); drop --quantization"
            )
        raise ValueError(
            f"--quantization {requested} does not match {what}, which is quantized with "
            f"{checkpoint_method}; drop --quantization or pass --quantization {checkpoint_method}"
        )
    method = requested or checkpoint_method
    if checkpoint_method is None and method and not quantization_format(method).is_online:
        raise ValueError(get_quantization_config(method).float_refusal(what))
    return method


def make_quantization_config(
    method: str | None, quantization: dict[str, Any] | None
) -> QuantizationConfig | None:
    """The registry's config for a resolved `method` (None: float), made from the checkpoint's
    `quantization_config` (none for online quantization); ValueError when refused."""
    if method is None:
        return None
    return get_quantization_config(method).from_config(quantization or {})


@dataclass(frozen=True, slots=True)
class QuantizationPlan:
    """The model's linear methods and the reader of its checkpoint tensors."""

    methods: LinearMethods
    wrap: Callable[[Weights], Weights]
    summary: str


Planner = Callable[[CausalLM], QuantizationPlan]
"""Makes the plan from the model's structure (built on the meta device)."""


def _destinations(model: CausalLM, names: Iterable[str]) -> dict[str, set[str]]:
    """Checkpoint tensor -> the module paths (of linear layers and vocabulary tables) it feeds."""
    found: dict[str, set[str]] = {}
    for name in names:
        for target in model.resolve_weight_name(name):
            if target.param != "weight":
                continue
            path = model.target_path(target)
            if path is None and target.module in VOCAB and target.layer is None:
                path = target.module  # tied LM head: planned with the embedding
            if path is None:
                continue
            is_vocab = path.rsplit(".", 1)[-1] in VOCAB
            if is_vocab or isinstance(model.get_submodule(path), LinearBase):
                found.setdefault(name, set()).add(path)
    return found


def split_paths(
    destinations: dict[str, set[str]], quantized: set[str]
) -> tuple[frozenset[str], frozenset[str]]:
    """(linear layers, vocabulary tables) all of whose checkpoint tensors are in `quantized`."""
    kept: set[str] = set()
    mixed: set[str] = set()
    for name, paths in destinations.items():
        (kept if name in quantized else mixed).update(paths)
    paths = kept - mixed
    vocab = {p for p in paths if p.rsplit(".", 1)[-1] in VOCAB}
    return frozenset(paths - vocab), frozenset(vocab)


def gguf_planner(names: list[str], quantized: set[str]) -> Planner:
    """A GGUF file served quantized: the layers whose tensors are all in a convertible format
    (the sources of those tensors already read quantized)."""

    def plan(model: CausalLM) -> QuantizationPlan:
        linear, vocab = split_paths(_destinations(model, names), quantized)
        floats = len(names) - len(quantized)
        summary = (
            f"GGUF served quantized: {len(linear)} linear layers, vocabulary {sorted(vocab)}; "
            f"{floats} tensors read as float"
        )
        return QuantizationPlan(QuantizedLinearMethods(linear, vocab=vocab), lambda w: w, summary)

    return plan


def compressed_tensors_planner(
    names: list[str], quantized: set[str], is_w8a8: bool, method: str
) -> Planner:
    """A compressed-tensors, AWQ or GPTQ checkpoint: its quantized layers (`quantized`: their
    `.weight` names, each read as one quantized source), W8A8 or weight-only."""

    def plan(model: CausalLM) -> QuantizationPlan:
        linear, _ = split_paths(_destinations(model, names), quantized)
        methods = (
            QuantizedLinearMethods(w8a8=linear)
            if is_w8a8
            else QuantizedLinearMethods(weight_only=linear)
        )
        kind = "W8A8" if is_w8a8 else "weight-only"
        summary = f"{method} ({kind}): {len(linear)} linear layers"
        return QuantizationPlan(methods, lambda w: w, summary)

    return plan


def online_planner(config: OnlineConfig, names: list[str]) -> Planner:
    """A float checkpoint quantized at load: every linear layer (`config`'s scheme), and the
    LM head with the embedding it is tied to (int8 per row)."""
    scheme = config.scheme
    method = config.get_name()

    def plan(model: CausalLM) -> QuantizationPlan:
        destinations = _destinations(model, names)
        linear, vocab = split_paths(destinations, set(names))
        vocab = frozenset(p for p in vocab if _feeds_lm_head(p, destinations))
        methods = (
            QuantizedLinearMethods(w8a8=linear, vocab=vocab)
            if config.is_w8a8
            else QuantizedLinearMethods(weight_only=linear, vocab=vocab)
        )

        def wrap(weights: Weights) -> Weights:
            for name, source in weights:
                paths = destinations.get(name, set())
                if paths & vocab:
                    yield name, OnlineQuantized(source, INT8_PER_ROW)
                elif paths & linear:
                    yield name, OnlineQuantized(source, scheme)
                else:
                    yield name, source

        summary = (
            f"--quantization {method}: {len(linear)} linear layers, vocabulary {sorted(vocab)}"
        )
        return QuantizationPlan(methods, wrap, summary)

    return plan


def _feeds_lm_head(path: str, destinations: dict[str, set[str]]) -> bool:
    """The LM head, or the embedding table whose checkpoint tensor the LM head shares."""
    if path.endswith("lm_head"):
        return True
    return any(
        path in paths and any(p.endswith("lm_head") for p in paths)
        for paths in destinations.values()
    )


def check_device(method: str, device_type: str) -> None:
    """The int8/int4 kernels are CPU-only: refuse online quantization on CUDA."""
    if device_type == "cuda" and is_online(method):
        raise ValueError(f"--quantization {method}: {CUDA_REFUSAL}")

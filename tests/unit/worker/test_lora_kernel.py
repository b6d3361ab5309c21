"""The LoRA computation of a step (layers/lora.py): the CPU kernel and both torch paths (the
padded batched matmuls of decodes, the loop over slots of long runs) add each run's adapter to
its rows, and nothing to the base model's rows, within rounding of a float64 reference; the
kernel skips a fused layer's zero blocks and padded ranks without changing the result."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from splitserve_contracts.engine_options_types import LoRAOptions
from worker_svc.kernels.cpu_kernels import CpuKernels
from worker_svc.layers.lora import LoraBatch, LoraLinearMethod, LoraShape

MAX_LORAS, RANK, IN = 4, 8, 48
PARTS = [40, 24, 24]  # a fused layer's columns on this rank (q, k, v)


def lora_method(dtype: torch.dtype, ranks: list[int]) -> LoraLinearMethod:
    """Slots with random block-diagonal adapters of the given ranks (0: an empty slot)."""
    method = LoraLinearMethod(None, LoraBatch(torch.device("cpu")), LoraShape(MAX_LORAS, RANK))  # type: ignore[arg-type]
    width, out = len(PARTS) * RANK, sum(PARTS)
    gen = torch.Generator().manual_seed(0)
    method.lora_a = torch.zeros(MAX_LORAS, width, IN, dtype=dtype)
    method.lora_b = torch.zeros(MAX_LORAS, width, out, dtype=dtype)
    method.col_offsets = torch.tensor(np.cumsum([0, *PARTS]), dtype=torch.long)
    for slot, rank in enumerate(ranks):
        for part, start in enumerate(method.col_offsets[:-1].tolist()):
            rows = slice(part * RANK, part * RANK + rank)
            method.lora_a[slot, rows] = torch.randn(rank, IN, generator=gen).to(dtype)
            cols = slice(start, start + PARTS[part])
            method.lora_b[slot, rows, cols] = torch.randn(rank, PARTS[part], generator=gen).to(
                dtype
            )
        method.slot_ranks[slot] = rank
    return method


def reference(x: torch.Tensor, method: LoraLinearMethod, row_slots: np.ndarray) -> torch.Tensor:
    delta = torch.zeros(x.shape[0], method.lora_b.shape[2], dtype=torch.float64)
    for row, slot in enumerate(row_slots.tolist()):
        if slot >= 0:
            a, b = method.lora_a[slot].double(), method.lora_b[slot].double()
            delta[row] = (x[row].double() @ a.T) @ b
    return delta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "row_slots",
    [
        [-1, -1, 0, 0, 1, 2, 2, 2, 3],  # a decode-like step: base rows, then short runs
        [-1] * 3 + [1] * 70 + [3] * 90,  # long runs (prefill chunks)
        [2] * 5,  # one adapter
    ],
)
@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_runs_get_their_adapter_and_base_rows_nothing(
    dtype: torch.dtype, row_slots: list[int], path: str
) -> None:
    kernels = CpuKernels.load() if path == "kernel" else None
    if path == "kernel" and kernels is None:
        pytest.skip("the CPU kernels do not build here")
    method = lora_method(dtype, ranks=[8, 3, 5, 8])
    method.batch = LoraBatch(torch.device("cpu"), kernels)
    slots = np.asarray(row_slots)
    method.batch.set_rows(slots, MAX_LORAS)
    x = torch.randn(len(slots), IN).to(dtype)
    base = torch.randn(len(slots), sum(PARTS)).to(dtype)
    y = base.clone()
    method.batch.add_delta(x, y, method)
    expected = reference(x, method, slots)
    tolerance = 1e-5 if dtype == torch.float32 else 0.02
    got = (y.double() - base.double()) / max(1.0, float(expected.abs().max()))
    assert float((got - expected / max(1.0, float(expected.abs().max()))).abs().max()) < tolerance
    assert torch.equal(y[slots < 0], base[slots < 0]), "the base model's rows get no adapter"


def test_the_lora_shape_is_the_slots_the_options_give() -> None:
    assert LoraShape.of(LoRAOptions()) is None  # no slots: LoRA is off
    options = LoRAOptions(max_loras=3, max_lora_rank=8, max_cpu_loras=5)
    assert LoraShape.of(options) == LoraShape(num_slots=3, max_rank=8)
    assert LoraShape(3, 8).options(5) == options
    assert LoraShape.of(LoraShape(3, 8).options()) == LoraShape(3, 8)

"""LoRA on the tensor-parallel linear layers: a method that wraps the layer's own method (vLLM's
LoRA layers wrap base layers), adapter weights in slots, one batched computation per layer.

    y = base(x) + (x A_s^T) B_s        for the rows of the step that run the adapter in slot s

Every wrapped layer keeps `num_slots` slots of stacked weights, `lora_a` [slots, R, in] and
`lora_b` [slots, R, out] (R = fused parts x max_rank; an adapter of a smaller rank is
zero-padded, its scaling folded into B, and a fused layer's parts (q/k/v, gate/up) sit in their
own R rows: B is block-diagonal). Sharded like the base weight (vLLM's punica layers):
column-parallel layers hold all of A and this rank's columns of B, row-parallel layers this
rank's columns of A and all of B, and add their partial product before the all-reduce.

The rows of a step are grouped by slot (the model runner orders them: base-model rows first,
then slot 0's, slot 1's, ...), so each active slot owns one contiguous run and `LoraBatch`
describes the step once for every layer: no per-request loop over the layers, nothing applied
to the base model's rows. On CPU the CPU kernels' `lora_add_` computes every run of a layer in
one call, reading each adapter's weights once and skipping B's zero blocks and padded ranks; the
torch path takes one padded batched matmul pair over the runs (decodes) or loops over the active
slots (long runs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from splitserve_contracts.engine_options_types import LoRAOptions
from splitserve_runtime.engine_option_rules import lora_enabled, lora_group, lora_slots
from worker_svc.kernels.cpu_kernels import CpuKernels
from worker_svc.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    LinearMethodBase,
    LinearMethods,
    WeightIndex,
)
from worker_svc.layers.tensor_source import TensorSource

GRID_MAX_RUN = 64
"""The torch path runs every slot in one batched matmul pair over a padded grid when the
longest run has at most this many rows (decodes); longer runs go slot by slot."""

LayerWeights = tuple[torch.Tensor, torch.Tensor, int]
"""One adapter's (A [R, in], B [R, out], its largest rank) for one layer."""


@dataclass(frozen=True, slots=True)
class LoraShape:
    """What every LoRA slot holds: `num_slots` slots of adapters of rank <= `max_rank`."""

    num_slots: int
    max_rank: int

    @classmethod
    def of(cls, lora: LoRAOptions) -> LoraShape | None:
        """The slots the engine's LoRA options give every rank; None: LoRA is off (no slots).
        The worker's one reader of the slot count."""
        return cls(lora_slots(lora), lora.max_lora_rank) if lora_enabled(lora) else None

    def options(self, num_cpu_adapters: int = 0) -> LoRAOptions:
        """The LoRA options that give this shape, with `num_cpu_adapters` adapters cached on
        the host (0: as many as the slots), for a rank built without the engine core."""
        return lora_group(self.num_slots, self.max_rank, num_cpu_adapters)


class LoraBatch:
    """Which rows of the current step run which adapter slot, shared by every LoRA layer of
    a model and set by the model runner before each forward. Rows [0, start) run the base
    model; `runs` lists (slot, first row, end row) of the adapter rows, slots ascending.
    `kernels` (CPU) computes a layer's runs in one call; None: the torch path."""

    def __init__(self, device: torch.device, kernels: CpuKernels | None = None) -> None:
        self.device = device
        self.kernels = kernels
        self.runs: list[tuple[int, int, int]] = []
        self.is_active = False
        self._runs = torch.zeros((0, 3), dtype=torch.long)
        self._grid: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None
        self._grid = None

    def clear(self) -> None:
        """The next forward runs the base model on every row."""
        self.runs, self.is_active, self._grid = [], False, None

    def set_rows(self, row_slots: np.ndarray, num_slots: int) -> None:
        """`row_slots[t]`: the slot of token row t (-1: base model), non-decreasing."""
        self.clear()
        if not len(row_slots) or row_slots[-1] < 0:
            return
        slots, starts = np.unique(row_slots, return_index=True)
        ends = np.append(starts[1:], len(row_slots))
        self.runs = [
            (int(s), int(a), int(b)) for s, a, b in zip(slots, starts, ends, strict=True) if s >= 0
        ]
        self.is_active = True
        if self.kernels is not None:
            self._runs = torch.tensor(self.runs, dtype=torch.long)
        elif len(self.runs) > 1 and max(b - a for _, a, b in self.runs) <= GRID_MAX_RUN:
            self._grid = self._make_grid(num_slots)

    def _make_grid(
        self, num_slots: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Row indices [runs, longest] (padding repeats a run's first row), the padding mask
        [runs, longest, 1], the flat row indices, and the slots to gather (None: every slot
        is active, in order, so the stacked weights are used as they are)."""
        longest = max(b - a for _, a, b in self.runs)
        offsets = np.arange(longest)
        starts = np.array([a for _, a, _ in self.runs])
        lengths = np.array([b - a for _, a, b in self.runs])
        is_row = offsets[None, :] < lengths[:, None]
        rows = np.where(is_row, starts[:, None] + offsets[None, :], starts[:, None])
        slots = [s for s, _, _ in self.runs]
        gather = None if slots == list(range(num_slots)) else torch.tensor(slots)
        to = self.device
        return (
            torch.from_numpy(rows).to(to),
            torch.from_numpy(is_row[:, :, None]).to(to),
            torch.from_numpy(rows.reshape(-1)).to(to),
            None if gather is None else gather.to(to),
        )

    def add_delta(self, x: torch.Tensor, y: torch.Tensor, method: LoraLinearMethod) -> None:
        """y[rows of slot s] += x[rows] A_s^T B_s for every run."""
        lora_a, lora_b = method.lora_a, method.lora_b
        if self.kernels is not None and x.stride(-1) == 1 and y.stride(-1) == 1:
            self.kernels.lora_add_(
                y, x, lora_a, lora_b, self._runs, method.col_offsets, method.slot_ranks
            )
            return
        grid = self._grid
        if grid is None:
            for slot, start, end in self.runs:
                y[start:end].addmm_(torch.mm(x[start:end], lora_a[slot].t()), lora_b[slot])
            return
        rows, mask, flat_rows, gather = grid
        if gather is not None:
            lora_a, lora_b = lora_a.index_select(0, gather), lora_b.index_select(0, gather)
        shrunk = torch.bmm(x[rows], lora_a.transpose(1, 2)).mul_(mask)
        y.index_add_(0, flat_rows, torch.bmm(shrunk, lora_b).view(-1, y.shape[-1]))


def num_lora_parts(layer: LinearBase) -> int:
    """The fused parts of a layer (q/k/v: 3, gate/up: 2), each with its own adapter."""
    return len(layer.part_sizes) if isinstance(layer, ColumnParallelLinear) else 1


def part_columns(layer: LinearBase) -> list[int]:
    """Where each fused part's columns start on this rank, and the end: [0, ..., out]."""
    if isinstance(layer, ColumnParallelLinear):
        return [*layer.part_offsets, layer.output_size_per_rank]
    return [0, layer.output_size_per_rank]


class LoraLinearMethod(LinearMethodBase):
    """A layer's own method (unquantized, FP8, ...) plus its LoRA slots (see the module
    docstring); the base method stores, loads and multiplies the base weight as before."""

    def __init__(self, base: LinearMethodBase, batch: LoraBatch, shape: LoraShape) -> None:
        self.base = base
        self.batch = batch
        self.shape = shape
        self.lora_a = torch.empty(0)
        self.lora_b = torch.empty(0)
        self.slot_ranks = torch.zeros(shape.num_slots, dtype=torch.long)
        """The largest rank of each slot's adapter in this layer (0: it leaves it alone)."""
        self.col_offsets = torch.zeros(2, dtype=torch.long)

    def create_weights(self, layer: LinearBase, dtype: torch.dtype, device: torch.device) -> None:
        self.base.create_weights(layer, dtype, device)
        width = num_lora_parts(layer) * self.shape.max_rank
        slots = self.shape.num_slots
        self.lora_a = torch.zeros(
            (slots, width, layer.input_size_per_rank), dtype=dtype, device=device
        )
        self.lora_b = torch.zeros(
            (slots, width, layer.output_size_per_rank), dtype=dtype, device=device
        )
        self.col_offsets = torch.tensor(part_columns(layer), dtype=torch.long)

    def load_weight(
        self, layer: LinearBase, source: TensorSource, index: WeightIndex, rows: slice
    ) -> None:
        self.base.load_weight(layer, source, index, rows)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.base.apply(layer, x, bias)
        if self.batch.is_active:
            self.batch.add_delta(x, y, self)
        return y

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        self.base.process_weights_after_loading(layer)

    def set_slot(self, slot: int, weights: LayerWeights | None) -> None:
        """Put an adapter's weights for this layer in `slot` (None: the adapter leaves the
        layer alone, its slot is zeros)."""
        if weights is None:
            self.lora_a[slot].zero_()
            self.lora_b[slot].zero_()
            self.slot_ranks[slot] = 0
            return
        self.lora_a[slot].copy_(weights[0])
        self.lora_b[slot].copy_(weights[1])
        self.slot_ranks[slot] = weights[2]


class LoraLinearMethods:
    """Every linear layer gets its base method (from `base`) wrapped with LoRA slots."""

    def __init__(self, base: LinearMethods, batch: LoraBatch, shape: LoraShape) -> None:
        self.base = base
        self.batch = batch
        self.shape = shape

    def method_for(self, layer: LinearBase, prefix: str) -> LinearMethodBase:
        return LoraLinearMethod(self.base.method_for(layer, prefix), self.batch, self.shape)

    def vocab_method(self, prefix: str) -> LinearMethodBase | None:
        """The embedding table and LM head take no adapters: the base's (quantized) method."""
        return self.base.vocab_method(prefix)

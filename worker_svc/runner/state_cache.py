"""The state cache of one rank: per state layer of its pipeline stage (Mamba2, gated DeltaNet),
one tensor per state shape with a row per state slot, beside the paged KV cache
(worker_svc/layers/state_cache.py has the layers' side of the seam).

The engine core's state group gives each request one slot for its life on the rank; slot 0 is
the null slot. A slot is zeroed when a request gets it (new or resumed after a preemption, when
its tokens are computed again from the first), so its first chunk starts from the zero state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from worker_svc.layers.state_cache import LayerCache, StateMetadata, StateSpec
from worker_svc.models.decoder import StepContext
from worker_svc.runner.step_inputs import IntArray, StepInputs

NULL_STATE_SLOT = 0


def state_bytes_per_slot(specs: Sequence[StateSpec | None]) -> int:
    return sum(spec.bytes_per_slot() for spec in specs if spec is not None)


class StateCache:
    """`num_slots` state slots for every state layer in `specs` (None entries: attention layers,
    which keep paged KV instead)."""

    def __init__(
        self, specs: Sequence[StateSpec | None], num_slots: int, device: torch.device
    ) -> None:
        if num_slots < 2:
            raise ValueError(
                f"num_state_slots must be >= 2 (slot 0 is the null slot), got {num_slots}"
            )
        self.specs = list(specs)
        self.num_slots = num_slots
        self.layers = [
            tuple(
                torch.zeros((num_slots, *shape), dtype=spec.dtype, device=device)
                for shape in spec.shapes
            )  # fmt: skip
            for spec in self.specs
            if spec is not None
        ]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer)

    def zero_slots(self, slots: IntArray) -> None:
        if not len(slots) or not self.layers:
            return
        if int(slots.max()) >= self.num_slots or int(slots.min()) <= NULL_STATE_SLOT:
            raise ValueError(f"state slot outside 1..{self.num_slots - 1}")
        index = torch.from_numpy(np.asarray(slots, np.int64)).to(self.layers[0][0].device)
        for layer in self.layers:
            for tensor in layer:
                tensor.index_fill_(0, index, 0)

    def layer_caches(self, kv_layers: Sequence[torch.Tensor]) -> list[LayerCache]:
        """Each layer's cache in layer order: state tensors for state layers, the next KV
        tensor for attention layers."""
        kv, state = iter(kv_layers), iter(self.layers)
        return [next(kv) if spec is None else next(state) for spec in self.specs]

    def with_state(
        self, ctx: StepContext, inputs: StepInputs, slots: IntArray, device: torch.device
    ) -> StepContext:
        """`ctx` with the step's StateMetadata: request i of `inputs` uses slot slots[i]."""
        query_start_loc = inputs.query_start_loc.tolist()
        lengths = np.diff(inputs.query_start_loc)
        context_lens = (inputs.seq_lens - lengths).tolist()
        metadata = StateMetadata.of(query_start_loc, context_lens, slots.tolist(), device)
        return dataclasses.replace(ctx, state=metadata)

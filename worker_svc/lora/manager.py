"""The rank's LoRA adapters: a host-memory cache of read adapters and the model's slots.

The engine core decides which adapter sits in which slot and sends only the changes with a step
(SchedulerOutput.lora_slots), and the adapters each request runs with when it first arrives
(NewRequestData.lora_id). An adapter is read once per rank into the cache (LoadLoraAdapter, or
at its first slot when the rank does not hold it: after a restart, or when more adapters were
used than `max_cpu_loras` and it was dropped, least recently used first) and copied into a slot
when it enters one. An adapter that cannot be read any more (its files gone) is remembered as
broken: the requests that run it are refused with the reason, the rest of the step runs.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from worker_svc.layers.linear import LinearBase
from worker_svc.layers.lora import LoraBatch, LoraLinearMethod, LoraShape
from worker_svc.lora.adapter import LoraAdapter, read_adapter
from worker_svc.lora.peft_config import AdapterError
from worker_svc.models.interfaces import CausalLM
from worker_svc.scheduler_output import LoraSlots
from worker_svc.step_checks import MalformedStep

logger = logging.getLogger(__name__)
NO_SLOT = -1
MAX_LORA_ID = (1 << 31) - 1


class LoraManager:
    """The adapters of one model shard; call it from the thread that drives the model."""

    def __init__(
        self,
        model: CausalLM,
        batch: LoraBatch,
        shape: LoraShape,
        max_cpu_loras: int,
        dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.batch = batch
        self.shape = shape
        self.max_cpu_loras = max(max_cpu_loras, shape.num_slots)
        self.dtype = dtype
        self.layers = [
            layer.method
            for layer in model.modules()
            if isinstance(layer, LinearBase) and isinstance(layer.method, LoraLinearMethod)
        ]
        self.cache: OrderedDict[int, LoraAdapter] = OrderedDict()
        self.slot_ids = [0] * shape.num_slots
        """The adapter in each slot (0: none)."""
        self.broken: dict[int, str] = {}
        """Adapters whose files could not be read at their slot, and why."""

    def read(self, lora_id: int, lora_path: str) -> LoraAdapter:
        """Read an adapter (AdapterError: why it cannot be served); touches no state, so it
        may run off the model's thread."""
        if not 0 < lora_id <= MAX_LORA_ID:
            raise AdapterError(f"lora_id {lora_id} is outside 1..{MAX_LORA_ID}")
        return read_adapter(self.model, lora_id, lora_path, self.shape, self.dtype)

    def keep(self, adapter: LoraAdapter) -> None:
        """Put a read adapter in the cache (most recently used), dropping the least recently
        used beyond `max_cpu_loras` (slots keep their own copies)."""
        self.broken.pop(adapter.lora_id, None)
        self.cache[adapter.lora_id] = adapter
        self.cache.move_to_end(adapter.lora_id)
        while len(self.cache) > self.max_cpu_loras:
            dropped, _ = self.cache.popitem(last=False)
            logger.info("LoRA adapter %d dropped from the host cache (least recently used)",
                        dropped)  # fmt: skip

    def set_step_rows(self, row_slots: np.ndarray) -> None:
        """The slot of every token row of the next forward (rows grouped by slot)."""
        self.batch.set_rows(row_slots, self.shape.num_slots)

    def apply_slots(self, update: LoraSlots | None, free_ids: Sequence[int]) -> None:
        """A step's slot changes and freed adapters, before it runs (MalformedStep, before any
        change, for a slot outside the rank's)."""
        if update is not None and any(not 0 <= s < self.shape.num_slots for s in update.slots):
            raise MalformedStep(f"a LoRA slot is outside 0..{self.shape.num_slots - 1}")
        for lora_id in free_ids:
            self.cache.pop(lora_id, None)
            self.broken.pop(lora_id, None)
            self.slot_ids = [0 if i == lora_id else i for i in self.slot_ids]
        if update is None:
            return
        for slot, lora_id, path in zip(update.slots, update.lora_ids, update.paths, strict=True):
            self.slot_ids[slot] = lora_id
            if lora_id:
                self._fill(slot, lora_id, path)

    def _fill(self, slot: int, lora_id: int, path: str) -> None:
        adapter = self.cache.get(lora_id)
        if adapter is None:
            try:
                adapter = self.read(lora_id, path)
            except AdapterError as err:
                self.broken[lora_id] = f"LoRA adapter {path} cannot be loaded: {err}"
                logger.warning("%s", self.broken[lora_id])
                return
            self.keep(adapter)
        self.cache.move_to_end(lora_id)
        for method in self.layers:
            method.set_slot(slot, adapter.weights.get(method))

    def row_slots(self, lora_ids: np.ndarray) -> tuple[np.ndarray, dict[int, str]]:
        """Each row's slot (NO_SLOT for the base model) for rows running `lora_ids`; and the
        adapters that cannot run this step (not in a slot, or broken), with why."""
        slots = np.full(len(lora_ids), NO_SLOT, np.int64)
        problems: dict[int, str] = {}
        for lora_id in np.unique(lora_ids).tolist():
            if lora_id == 0:
                continue
            if lora_id in self.broken:
                problems[lora_id] = self.broken[lora_id]
            elif lora_id not in self.slot_ids:
                problems[lora_id] = f"LoRA adapter {lora_id} is in no slot of this step"
            else:
                slots[lora_ids == lora_id] = self.slot_ids.index(lora_id)
        return slots, problems

"""Which LoRA adapters a step may run, and in which of the workers' slots (vLLM's scheduler
rule: at most --max-loras distinct adapters among the running requests).

A request with an adapter may start running only when its adapter already runs or a slot can
take one more; otherwise it waits and the scheduler tries the requests behind it (it blocks
nobody). An adapter holds its slot while any running request uses it; a slot no running request
needs goes to the next adapter that starts (the one it held stays there, so a later request of
it finds it in place). The changes made while a step is built travel with that step
(`take_changes`, columnar), and so do the adapters unloaded since (`free_lora_ids`) once no
request uses them any more: requests added before an unload finish with their adapter.
"""

from __future__ import annotations

from dataclasses import dataclass

from core_svc.lora import LoraRequest
from core_svc.request import Request
from core_svc.sched.scheduler_output import LoraSlots
from splitserve_contracts.engine_options_types import LoRAOptions
from splitserve_runtime.engine_option_rules import lora_slots


@dataclass(slots=True)
class _Adapter:
    request: LoraRequest
    num_live: int = 0
    """Requests in the scheduler (running or waiting) that run it."""
    num_running: int = 0


class LoraSlotTable:
    """The adapters of the scheduler's requests and the workers' slots; see the module
    docstring."""

    def __init__(self, lora: LoRAOptions) -> None:
        self.num_slots = lora_slots(lora)
        """The workers' adapter slots (0: LoRA is off)."""
        self.slot_ids = [0] * self.num_slots
        """The adapter in each slot, as the workers will have it after the steps sent."""
        self._adapters: dict[int, _Adapter] = {}
        self._num_running_adapters = 0
        self._changes: dict[int, LoraRequest | None] = {}
        self._retired: set[int] = set()
        self._free_ids: list[int] = []

    def add(self, request: Request) -> None:
        """A request with an adapter joined the scheduler."""
        lora = request.lora
        assert lora is not None
        adapter = self._adapters.get(lora.lora_id)
        if adapter is None:
            adapter = self._adapters[lora.lora_id] = _Adapter(lora)
        adapter.num_live += 1

    def remove(self, request: Request) -> None:
        """A request with an adapter left the scheduler (finished, aborted, failed)."""
        lora = request.lora
        assert lora is not None
        self.release(request)
        adapter = self._adapters[lora.lora_id]
        adapter.num_live -= 1
        if adapter.num_live == 0:
            del self._adapters[lora.lora_id]
            if lora.lora_id in self._retired:
                self._free(lora.lora_id)

    def can_run(self, lora: LoraRequest) -> bool:
        """Whether a request of `lora` may start running now."""
        adapter = self._adapters.get(lora.lora_id)
        is_running = adapter is not None and adapter.num_running > 0
        return is_running or self._num_running_adapters < self.num_slots

    def acquire(self, request: Request) -> None:
        """The request starts running (can_run said it may): its adapter holds a slot."""
        lora = request.lora
        assert lora is not None and not request.holds_lora_slot
        adapter = self._adapters[lora.lora_id]
        if adapter.num_running == 0:
            self._num_running_adapters += 1
            if lora.lora_id not in self.slot_ids:
                self._place(lora)
        adapter.num_running += 1
        request.holds_lora_slot = True

    def release(self, request: Request) -> None:
        """The request stops running (preempted, finished): its adapter may leave its slot."""
        if not request.holds_lora_slot:
            return
        assert request.lora is not None
        request.holds_lora_slot = False
        adapter = self._adapters[request.lora.lora_id]
        adapter.num_running -= 1
        if adapter.num_running == 0:
            self._num_running_adapters -= 1

    def _place(self, lora: LoraRequest) -> None:
        """Put `lora` in a slot no running adapter needs (an empty one first)."""
        busy = {i for i, a in self._adapters.items() if a.num_running}
        free = [s for s, lora_id in enumerate(self.slot_ids) if lora_id not in busy]
        slot = next((s for s in free if self.slot_ids[s] == 0), free[0])
        self.slot_ids[slot] = lora.lora_id
        self._changes[slot] = lora

    def retire(self, lora_id: int) -> int:
        """The adapter was unloaded: the workers drop it once no request runs it. Returns the
        requests that still do."""
        adapter = self._adapters.get(lora_id)
        if adapter is None:
            self._free(lora_id)
            return 0
        self._retired.add(lora_id)
        return adapter.num_live

    def _free(self, lora_id: int) -> None:
        self._retired.discard(lora_id)
        self._free_ids.append(lora_id)
        for slot, slot_id in enumerate(self.slot_ids):
            if slot_id == lora_id:
                self.slot_ids[slot] = 0
                self._changes.pop(slot, None)

    def take_changes(self) -> tuple[LoraSlots | None, list[int]]:
        """The slot changes and freed adapters since the previous step, for the next one."""
        changes, self._changes = self._changes, {}
        free_ids, self._free_ids = self._free_ids, []
        if not changes:
            return None, free_ids
        slots = sorted(changes)
        requests = [changes[s] for s in slots]
        return (
            LoraSlots(
                slots=slots,
                lora_ids=[0 if r is None else r.lora_id for r in requests],
                lora_paths=["" if r is None else r.path for r in requests],
            ),
            free_ids,
        )

    def reset(self) -> None:
        """The workers were brought up again with empty slots and caches (recovery); every
        request is waiting again (released)."""
        self.slot_ids = [0] * self.num_slots
        self._changes.clear()
        self._free_ids.clear()

    def adapter_names(self) -> tuple[list[str], list[str]]:
        """Names of the adapters of the running and of the waiting requests, sorted."""
        running = sorted({a.request.name for a in self._adapters.values() if a.num_running})
        waiting = sorted(
            {a.request.name for a in self._adapters.values() if a.num_live > a.num_running}
        )
        return running, waiting

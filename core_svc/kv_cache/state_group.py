"""The state group of a model with state layers (vLLM's MambaManager, mamba_cache_mode
"none"): each request holds one state slot, whatever its length, from its first allocation
until it is freed or preempted.

A slot holds, on every rank, each state layer's fixed-size state (Mamba2's convolution inputs
and SSM state, gated DeltaNet's recurrent state) after the request's last computed token. It
cannot be shared or cached: a prefix's state is not kept per block, so a model with state
layers runs with prefix caching off (core_svc/assembly.py). Slot 0 is the null slot, never
handed out.
"""

from __future__ import annotations

NULL_STATE_SLOT = 0


class StateSlotPool:
    """`num_slots` slots (the null slot included) and which request holds which."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 2:
            raise ValueError(
                f"num_state_slots must be >= 2 (slot 0 is the null slot), got {num_slots}"
            )
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, NULL_STATE_SLOT, -1))
        """Free slots, the lowest last (popped first)."""
        self._held: dict[int, int] = {}
        """Request handle -> its slot."""

    @property
    def num_usable_slots(self) -> int:
        return self.num_slots - 1

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def get_usage(self) -> float:
        """Fraction of usable slots held by requests; exactly 0.0 when none are."""
        return len(self._held) / self.num_usable_slots

    def num_needed(self, req_handle: int) -> int:
        """Slots an allocation for the request takes: 1 unless it holds one already."""
        return 0 if req_handle in self._held else 1

    def allocate(self, req_handle: int) -> int:
        """The request's slot, taken from the free ones if it holds none (checked: one is
        free)."""
        slot = self._held.get(req_handle)
        if slot is None:
            slot = self._held[req_handle] = self._free.pop()
        return slot

    def get(self, req_handle: int) -> int:
        """The request's slot; the null slot when it holds none."""
        return self._held.get(req_handle, NULL_STATE_SLOT)

    def free(self, req_handle: int) -> None:
        slot = self._held.pop(req_handle, None)
        if slot is not None:
            self._free.append(slot)

    @property
    def num_held(self) -> int:
        return len(self._held)

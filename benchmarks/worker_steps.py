"""Steps for benchmarking one worker rank without an engine core: a loaded Worker plus the
bookkeeping of a core that never frees blocks (benchmarks/worker.py, worker_lora.py)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from splitserve_contracts.output_types import ModelRunnerOutput, StepStatus
from splitserve_contracts.sampling_types import SamplerParams
from worker_svc.scheduler_output import (
    CachedRequestData,
    LoraSlots,
    NewRequestData,
    SchedulerOutput,
)
from worker_svc.worker import Worker

BLOCK_SIZE = 16
GREEDY = SamplerParams(temperature=0.0)


def arr(values: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


class Session:
    """A loaded worker plus the bookkeeping of an engine core that never frees blocks."""

    def __init__(self, worker: Worker, num_blocks: int, num_state_slots: int = 0) -> None:
        self.worker = worker
        self.step_id = 0
        self.next_block = 1  # block 0 is the null block
        self.next_handle = 0
        self.num_blocks = num_blocks
        self.num_state_slots = num_state_slots
        """A model with state layers: its slots (slot 0 the null one), handed out in turn."""

    def blocks(self, num_tokens: int) -> np.ndarray:
        count = -(-num_tokens // BLOCK_SIZE)
        if self.next_block + count > self.num_blocks:
            self.next_block = 1  # reuse: contents do not matter for timing
        ids = np.arange(self.next_block, self.next_block + count)
        self.next_block += count
        return ids

    def execute(
        self,
        new: list[NewRequestData],
        sched: list[int],
        cached: CachedRequestData | None = None,
        finished: Sequence[int] = (),
        lora_slots: LoraSlots | None = None,
    ) -> tuple[ModelRunnerOutput, float]:
        self.step_id += 1
        step = SchedulerOutput(
            step_id=self.step_id,
            scheduled_new_reqs=new,
            scheduled_cached_reqs=cached or CachedRequestData(),
            num_scheduled_tokens=arr(sched),
            total_num_scheduled_tokens=sum(sched),
            finished_req_handles=arr(finished),
            lora_slots=lora_slots,
        )
        started = time.perf_counter()
        out = self.worker.execute(step)
        elapsed = time.perf_counter() - started
        assert out is not None and out.status == StepStatus.OK
        return out, elapsed

    def new_request(self, prompt: np.ndarray, num_computed: int, reserve: int) -> NewRequestData:
        """A request whose first `num_computed` tokens count as cached (0 with state layers:
        a state starts at the first token); a state slot of its own, if the model has them."""
        self.next_handle += 1
        slot = 0
        if self.num_state_slots:
            slot = 1 + (self.next_handle - 1) % (self.num_state_slots - 1)
        return NewRequestData(
            self.next_handle,
            f"b{self.next_handle}",
            prompt,
            GREEDY,
            self.blocks(len(prompt) + reserve),
            num_computed,
            state_slot=slot,
        )


def decode_cached(
    handles: list[int], num_computed: list[int], tokens: list[int]
) -> CachedRequestData:
    n = len(handles)
    return CachedRequestData(
        req_handles=arr(handles),
        num_computed_tokens=arr(num_computed),
        num_new_block_ids=np.zeros(n, np.int64),
        new_block_ids=np.zeros(0, np.int64),
        num_new_token_ids=np.ones(n, np.int64),
        new_token_ids=arr(tokens),
    )

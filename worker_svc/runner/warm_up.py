"""The steps of a rank's start-up warm-up (vLLM's compile_or_warm_up_model: a dummy run and a
dummy sampler run before the engine serves).

One dummy greedy request goes through the whole step path a real request takes, so the first
request after start-up pays none of its one-off costs (the kernels' and oneDNN's first use, the
allocator's growth, the input batch's and the sampler's first calls and the imports they make):
a prefill of WARM_UP_PROMPT_TOKENS tokens, one decode step, a step that finishes it. It runs
right after the KV cache is allocated, before the rank serves any step, in blocks 1.. of the new
cache (no request holds any yet; block 0 is the null block), and leaves the input batch empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from splitserve_contracts.sampling_types import SamplerParams
from worker_svc.layers.state_cache import StateSpec
from worker_svc.lora.manager import LoraManager
from worker_svc.models.interfaces import CausalLM
from worker_svc.runner.encoder_runner import MmEmbeddings
from worker_svc.runner.kv_cache import PagedKVCache
from worker_svc.runner.pooler import Pooler
from worker_svc.runner.state_cache import StateCache
from worker_svc.runner.step_inputs import StepInputs
from worker_svc.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

WARM_UP_PROMPT_TOKENS = 8
WARM_UP_HANDLE = -1
"""A handle the engine core never gives (its handles count up from 1)."""


def warm_up_steps(
    block_size: int, num_blocks: int, is_async_scheduling: bool, state: StateCache | None = None
) -> list[SchedulerOutput]:
    """The dummy request's prefill, decode and finishing steps (none when the cache's
    `num_blocks` cannot hold it). Under async scheduling the rank appends its sampled token
    itself; otherwise the decode step brings it (token 0: what it is does not matter). With a
    state cache the request takes state slot 1 (zeroed again by the next request given it)."""
    num_tokens = WARM_UP_PROMPT_TOKENS + 1
    blocks = np.arange(1, 1 + -(-num_tokens // block_size), dtype=np.int64)
    if len(blocks) >= num_blocks:
        return []
    prefill = SchedulerOutput(
        step_id=0,
        scheduled_new_reqs=[
            NewRequestData(
                req_handle=WARM_UP_HANDLE,
                request_id="warm-up",
                prompt_token_ids=np.zeros(WARM_UP_PROMPT_TOKENS, np.int64),
                sampling=SamplerParams(temperature=0.0),
                block_ids=blocks,
                state_slot=0 if state is None else 1,
            )
        ],
        num_scheduled_tokens=np.array([WARM_UP_PROMPT_TOKENS]),
        total_num_scheduled_tokens=WARM_UP_PROMPT_TOKENS,
    )
    new_tokens = np.zeros(0 if is_async_scheduling else 1, np.int64)
    decode = SchedulerOutput(
        step_id=0,
        scheduled_cached_reqs=CachedRequestData(
            req_handles=np.array([WARM_UP_HANDLE]),
            num_computed_tokens=np.array([WARM_UP_PROMPT_TOKENS]),
            num_new_block_ids=np.zeros(1, np.int64),
            num_new_token_ids=np.array([len(new_tokens)]),
            new_token_ids=new_tokens,
        ),
        num_scheduled_tokens=np.array([1]),
        total_num_scheduled_tokens=1,
    )
    finish = SchedulerOutput(step_id=0, finished_req_handles=np.array([WARM_UP_HANDLE]))
    return [prefill, decode, finish]


def dummy_step_inputs(start: int, end: int, block_size: int) -> StepInputs:
    """Positions [start, end) of one request whose tokens sit in blocks 1, 2, ... of a scratch
    cache (block 0 is the null block), the last one sampling: the inputs of the runner's
    dummy steps (warm-up in a scratch cache, memory profiling)."""
    num_blocks = -(-end // block_size)
    positions = np.arange(start, end)
    return StepInputs(
        rows=np.zeros(1, np.int64),
        req_handles=np.zeros(1, np.int64),
        input_ids=np.zeros(end - start, np.int64),
        positions=positions,
        slot_mapping=positions + block_size,
        query_start_loc=np.array([0, end - start]),
        seq_lens=np.array([end]),
        block_tables=np.arange(1, num_blocks + 1)[None, :],
        logits_indices=np.array([end - start - 1]),
        sampling_reqs=np.zeros(1, np.int64),
    )


ScratchState = tuple[StateCache, np.ndarray] | None


class DummyStepRunner(Protocol):
    """What the dummy steps need of the model runner (runner/model_runner.py)."""

    @property
    def state_specs(self) -> Sequence[StateSpec | None]: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def lora(self) -> LoraManager | None: ...
    @property
    def pooler(self) -> Pooler | None: ...
    @property
    def model(self) -> CausalLM: ...

    def forward_step(
        self,
        inputs: StepInputs,
        kv_cache: PagedKVCache,
        mm: MmEmbeddings | None = None,
        state: ScratchState = None,
    ) -> torch.Tensor | None: ...


def scratch_state(runner: DummyStepRunner) -> ScratchState:
    """A state cache of its own for a model with state layers' dummy steps (slot 1), or None."""
    if not runner.state_specs:
        return None
    return StateCache(runner.state_specs, 2, runner.device), np.ones(1, np.int64)


def dummy_step(
    runner: DummyStepRunner,
    cache: PagedKVCache,
    state: ScratchState,
    start: int,
    end: int,
    num_logits: int,
) -> None:
    """Forward positions [start, end) of one request whose first `start` tokens sit in
    blocks 1, 2, ... of `cache` (block 0 is the null block); then logits and an argmax for
    the last `num_logits` (the runner's warm-up in a scratch cache, memory profiling)."""
    if runner.lora is not None:
        runner.lora.batch.clear()
    inputs = dummy_step_inputs(start, end, cache.block_size)
    hidden = runner.forward_step(inputs, cache, state=state)
    assert hidden is not None
    if runner.pooler is not None:
        return
    runner.model.compute_logits(hidden[-num_logits:]).softmax(dim=-1).argmax(dim=-1)

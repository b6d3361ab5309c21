"""What the model runner makes of a step before its forward, beside the batch's own inputs
(worker_svc/runner/input_batch.py): the step's LoRA slots and its rows grouped by adapter, and the
attention backend's inputs.

Rows are grouped by LoRA slot, base-model rows first, so each slot's tokens are one contiguous
run for the LoRA kernels (vLLM's punica wrapper sorts its tokens the same way).
"""

from __future__ import annotations

import numpy as np

from worker_svc.attention.backend import AttentionInputs
from worker_svc.lora.manager import NO_SLOT, LoraManager
from worker_svc.runner.input_batch import InputBatch
from worker_svc.runner.kv_cache import PagedKVCache
from worker_svc.runner.step_inputs import IntArray, StepInputs, StepPlan
from worker_svc.scheduler_output import SchedulerOutput
from worker_svc.step_checks import MalformedStep


def apply_lora_slots(lora: LoraManager | None, step: SchedulerOutput) -> None:
    """The step's LoRA slot changes and freed adapters, before its requests are added."""
    if step.lora_slots is None and not step.free_lora_ids:
        return
    if lora is None:
        raise MalformedStep("the step changes LoRA slots, but LoRA is off on this rank")
    lora.apply_slots(step.lora_slots, step.free_lora_ids)


def group_by_adapter(
    batch: InputBatch, lora: LoraManager | None, plan: StepPlan
) -> tuple[StepPlan, IntArray]:
    """The step's rows grouped by LoRA slot, base-model rows first (each slot's rows one
    contiguous run), with each row's slot (NO_SLOT: the base model); requests whose adapter
    cannot run here are refused."""
    lora_ids = batch.lora_ids[plan.rows]
    if not lora_ids.any():
        return plan, np.full(len(plan.rows), NO_SLOT, np.int64)
    if lora is None:
        off = "LoRA is off on this rank (the engine runs without --enable-lora)"
        plan = batch.refuse(plan, {int(i): off for i in np.flatnonzero(lora_ids)})
        return plan, np.full(len(plan.rows), NO_SLOT, np.int64)
    slots, problems = lora.row_slots(lora_ids)
    if problems:
        bad = {i: problems[lora_id] for i, lora_id in enumerate(lora_ids.tolist())
               if lora_id in problems}  # fmt: skip
        keep = np.ones(len(slots), np.bool_)
        keep[list(bad)] = False
        plan, slots = batch.refuse(plan, bad), slots[keep]
    order = np.argsort(slots, kind="stable")
    return plan.reordered(order), slots[order]


def attention_inputs(inputs: StepInputs, kv_cache: PagedKVCache) -> AttentionInputs:
    """What the attention backend builds the step's metadata from."""
    return AttentionInputs(
        query_start_loc=inputs.query_start_loc,
        seq_lens=inputs.seq_lens,
        block_tables=inputs.block_tables,
        slot_mapping=inputs.slot_mapping,
        block_size=kv_cache.block_size,
        null_block_id=kv_cache.null_block_id,
    )

"""Checks of a step the engine core sent, before the rank changes any state for it.

The core is a peer, and a peer's data is untrusted. A step whose columns do not even line up is
malformed as a whole (`MalformedStep`: the rank answers it with an error and changes nothing).
Anything wrong with one request's data fails that request only: the rank refuses it, keeps no
state for it and reports it in the step's output, and the rest of the step runs.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from worker_svc.scheduler_output import CachedRequestData, SchedulerOutput

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


class MalformedStep(ValueError):
    """The step's columns contradict each other; no request of it can be trusted."""


def check_step_shape(step: SchedulerOutput) -> None:
    """Raise MalformedStep unless every column has the length its companions say."""
    cached = step.scheduled_cached_reqs
    num_cached = cached.num_reqs
    problems = [
        (len(step.num_scheduled_tokens) != step.num_reqs, "num_scheduled_tokens"),
        (len(step.num_spec_tokens) not in (0, step.num_reqs), "num_spec_tokens"),
        (int(step.num_scheduled_tokens.sum()) != step.total_num_scheduled_tokens, "total"),
        (len(cached.num_computed_tokens) != num_cached, "num_computed_tokens"),
        (len(cached.num_new_block_ids) != num_cached, "num_new_block_ids"),
        (len(cached.num_new_token_ids) != num_cached, "num_new_token_ids"),
        (int(cached.num_new_block_ids.sum()) != len(cached.new_block_ids), "new_block_ids"),
        (int(cached.num_new_token_ids.sum()) != len(cached.new_token_ids), "new_token_ids"),
        (len(cached.num_resumed_token_ids) != len(cached.resumed_req_handles), "resumed"),
        (
            int(cached.num_resumed_token_ids.sum()) != len(cached.resumed_all_token_ids),
            "resumed_all_token_ids",
        ),
        (
            len(cached.resumed_state_slots) not in (0, len(cached.resumed_req_handles)),
            "resumed_state_slots",
        ),
    ]
    for is_wrong, column in problems:
        if is_wrong:
            raise MalformedStep(f"malformed step {step.step_id}: {column} does not line up")
    counts = [*cached.num_new_block_ids, *cached.num_new_token_ids, *step.num_scheduled_tokens]
    if counts and min(int(c) for c in counts) < 0:
        raise MalformedStep(f"malformed step {step.step_id}: a negative count")
    handles = [new.req_handle for new in step.scheduled_new_reqs] + cached.req_handles.tolist()
    if len(set(handles)) != len(handles):
        raise MalformedStep(f"malformed step {step.step_id}: a request is scheduled twice")
    if not set(cached.resumed_req_handles.tolist()) <= set(cached.req_handles.tolist()):
        raise MalformedStep(f"malformed step {step.step_id}: a resumed request is not scheduled")


def bad_runs(counts: IntArray, values: IntArray, low: int, high: int) -> BoolArray:
    """Per run of a ragged column (run i: the next counts[i] values), whether any value is
    outside [low, high)."""
    bad = np.zeros(len(counts), np.bool_)
    if len(values):
        is_bad_value = (values < low) | (values >= high)
        bad[np.repeat(np.arange(len(counts)), counts)[is_bad_value]] = True
    return bad


def select_cached(cached: CachedRequestData, keep: BoolArray) -> CachedRequestData:
    """The entries of `cached` where keep is True, with their slices of the flat columns."""
    kept_handles = cached.req_handles[keep]
    keep_resumed = np.isin(cached.resumed_req_handles, kept_handles)
    return CachedRequestData(
        req_handles=kept_handles,
        num_computed_tokens=cached.num_computed_tokens[keep],
        num_new_block_ids=cached.num_new_block_ids[keep],
        new_block_ids=cached.new_block_ids[np.repeat(keep, cached.num_new_block_ids)],
        num_new_token_ids=cached.num_new_token_ids[keep],
        new_token_ids=cached.new_token_ids[np.repeat(keep, cached.num_new_token_ids)],
        resumed_req_handles=cached.resumed_req_handles[keep_resumed],
        num_resumed_token_ids=cached.num_resumed_token_ids[keep_resumed],
        resumed_all_token_ids=cached.resumed_all_token_ids[
            np.repeat(keep_resumed, cached.num_resumed_token_ids)
        ],
        resumed_state_slots=cached.resumed_state_slots[keep_resumed]
        if len(cached.resumed_state_slots)
        else cached.resumed_state_slots,
    )

"""How many prompt tokens one step computes: the scheduler's latency policy.

Static limits (vLLM's): `long_prefill_token_threshold` caps one request's chunk per step, and
`prefill_token_budget` caps all prompt tokens of a step while some request decodes.

The adaptive chunk (`adaptive_prefill_chunk` = N > 0) sizes the step to what is running and
waiting, so the step stays short when its length is what the tails are made of, and long
when that pays:

- while at least MIN_DECODES_TO_CHUNK requests decode and at most MAX_PENDING_TO_CHUNK have
  prompt tokens to compute (a light load: every step carries several decoders, whose
  inter-token gap it is), a step computes at most N prompt tokens, one request's chunk
  included;
- with fewer decoders, a long step stretches few gaps while every extra chunk costs its
  prompt a step's fixed cost (its TTFT): the prompt goes whole, within the static limits;
- with more prompts pending (a burst, or a cluster of arrivals) the whole token budget: they
  go through in as few steps as possible (throughput, and the TTFT of whoever waits);
- with async scheduling, no step is built ahead of one that computes prompt tokens: a request
  arriving while such a (long) step runs is admitted into the very next step rather than the
  one after a step already built without it. Decode steps, short and many, still overlap the
  next one's scheduling (and so do a pooling model's steps, all prompts).

The thresholds and the default N come from `python -m benchmarks.latency_policy` (the real
scheduler on a virtual clock; docs/benchmarks.md, "Latency policy").
"""

from __future__ import annotations

from collections.abc import Sequence

from core_svc.request import Request
from core_svc.sched.scheduler_config import SchedulerConfig

MIN_DECODES_TO_CHUNK = 3
"""Decoding requests from which the adaptive chunk applies."""
MAX_PENDING_TO_CHUNK = 3
"""Most requests with prompt tokens to compute (running or waiting) for which it applies."""


class PrefillPolicy:
    """Per step: the cap on one request's prefill chunk and on all prompt tokens; and whether
    the engine may build the next step before this one's output is back."""

    def __init__(self, config: SchedulerConfig) -> None:
        options = config.scheduler
        self.max_num_batched_tokens = options.max_num_batched_tokens
        self.long_prefill_token_threshold = options.long_prefill_token_threshold
        self.prefill_token_budget = options.prefill_token_budget
        chunk = options.adaptive_prefill_chunk
        if chunk and options.disable_chunked_mm_input:
            chunk = max(chunk, config.max_tokens_per_mm_item)  # a whole image fits a step
        self.adaptive_chunk = chunk
        self.holds_steps_ahead = bool(chunk) and not config.is_pooling
        """Whether a step that computes prompt tokens is applied before the next is built (not
        for a pooling model: every step of it computes prompts, and none decodes)."""
        self.num_prefill_tokens = 0
        """Prompt tokens of the step built last (the scheduler sets it)."""

    def limits(self, running: Sequence[Request], num_waiting: int) -> tuple[int, int]:
        """This step's cap on one request's prefill chunk (0: none) and on all its prompt
        tokens, given the running requests and the number of waiting ones."""
        threshold = self.long_prefill_token_threshold
        budget = self.max_num_batched_tokens
        if not (self.prefill_token_budget or self.adaptive_chunk):
            return threshold, budget
        num_decodes, num_pending = count_phases(running, num_waiting)
        if not num_decodes:
            return threshold, budget
        if self.prefill_token_budget:
            budget = min(budget, self.prefill_token_budget)
        chunk = self.adaptive_chunk
        if chunk and num_decodes >= MIN_DECODES_TO_CHUNK and num_pending <= MAX_PENDING_TO_CHUNK:
            budget = min(budget, chunk)
            threshold = min(threshold, chunk) if threshold else chunk
        return threshold, budget

    def may_schedule_ahead(self) -> bool:
        """Whether the engine may build the next step while the last one built runs."""
        return not (self.holds_steps_ahead and self.num_prefill_tokens)


def count_phases(running: Sequence[Request], num_waiting: int) -> tuple[int, int]:
    """Running requests that decode (one known token to compute), and requests with prompt
    tokens (or, resumed, tokens to recompute) left: the waiting ones and the running ones
    with more than one token to compute. Stops once there are MIN_DECODES_TO_CHUNK decoders
    and more than MAX_PENDING_TO_CHUNK pending (lower bounds then), so a large batch costs
    little."""
    num_decodes = 0
    num_pending = num_waiting
    for request in running:
        num_new = len(request.all_token_ids) + request.num_output_placeholders
        num_new -= request.num_computed_tokens
        if num_new == 1:
            num_decodes += 1
        elif num_new > 1:
            num_pending += 1
        if num_decodes >= MIN_DECODES_TO_CHUNK and num_pending > MAX_PENDING_TO_CHUNK:
            break
    return num_decodes, num_pending

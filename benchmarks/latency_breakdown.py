"""Where the slowest requests' time goes, from a step log on the virtual clock.

`benchmarks.latency_policy` records every step the engine sends (when it was built, when the
worker started and finished it, how many tokens each request computed in it) and the time
every token reached the client. From those, per request:

    TTFT = waiting + in_flight + prefill
    waiting    arrival -> the step that admits its first chunk is built (the core's waiting
               queue: vLLM's vllm:request_queue_time_seconds ends here)
    in_flight  that step built -> the worker starts it, behind the step(s) already sent
               (async scheduling builds a step while the one before it runs)
    prefill    that step starts -> its first token (vLLM's vllm:request_prefill_time_seconds)

with the steps it waited behind (those that ran between its arrival and its first chunk) and
the other requests' prompt tokens in them and in its own prefill chunks. For inter-token
latency, the slowest gaps name the step that made them: its prompt tokens and decodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepRecord:
    """One step on the virtual clock."""

    scheduled_at: float
    """When the engine built it (the waiting requests it could admit had arrived by then)."""
    start: float
    """When the worker started it (after the step before it, with async scheduling)."""
    end: float
    """When its output reached the engine (and its tokens the client)."""
    num_new_tokens: dict[int, int]
    """Tokens each scheduled request (by req_handle) computes in it."""
    prefill_handles: frozenset[int]
    """Those of them that compute prompt tokens (a chunk, not one decode token)."""

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.num_new_tokens[h] for h in self.prefill_handles)

    @property
    def num_decodes(self) -> int:
        return len(self.num_new_tokens) - len(self.prefill_handles)


@dataclass(frozen=True)
class TtftBreakdown:
    handle: int
    num_prompt_tokens: int
    ttft_ms: float
    waiting_ms: float
    in_flight_ms: float
    prefill_ms: float
    num_steps_waited: int
    """Steps that ran between its arrival and its first chunk."""
    prefill_tokens_ahead: int
    """Other requests' prompt tokens in those steps."""
    num_chunks: int
    """Steps its prompt took."""
    prefill_tokens_shared: int
    """Other requests' prompt tokens in its own prefill steps."""
    slowest_step_ahead_ms: float
    """The longest step it waited behind (0 when none)."""


def ttft_breakdown(
    handle: int, num_prompt_tokens: int, arrival: float, first_token: float, steps: list[StepRecord]
) -> TtftBreakdown:
    """`handle`'s TTFT split into its parts, from the steps it was scheduled in."""
    own = [s for s in steps if handle in s.num_new_tokens and s.end <= first_token]
    first = own[0]
    ahead = [s for s in steps if s.end > arrival and s.start < first.start]
    return TtftBreakdown(
        handle=handle,
        num_prompt_tokens=num_prompt_tokens,
        ttft_ms=1e3 * (first_token - arrival),
        waiting_ms=1e3 * (first.scheduled_at - arrival),
        in_flight_ms=1e3 * (first.start - first.scheduled_at),
        prefill_ms=1e3 * (first_token - first.start),
        num_steps_waited=len(ahead),
        prefill_tokens_ahead=sum(s.num_prefill_tokens for s in ahead),
        num_chunks=len(own),
        prefill_tokens_shared=sum(s.num_prefill_tokens - s.num_new_tokens[handle] for s in own),
        slowest_step_ahead_ms=1e3 * max((s.end - s.start for s in ahead), default=0.0),
    )


def slowest(values: Sequence[float], num: int) -> list[int]:
    """Indices of the `num` largest values, largest first."""
    return sorted(range(len(values)), key=lambda i: values[i], reverse=True)[:num]


def itl_gap_causes(
    token_times: dict[int, list[float]], steps: list[StepRecord], num: int
) -> list[dict[str, float]]:
    """The `num` longest gaps between two tokens of one request, each with the step that
    ended it: its duration, prompt tokens and decodes (a gap longer than that step also
    spans the step before it: with async scheduling, or a step the request sat out)."""
    by_end = {round(s.end, 9): s for s in steps}
    gaps = [
        (b - a, b) for times in token_times.values() for a, b in zip(times, times[1:], strict=False)
    ]
    gaps.sort(reverse=True)
    rows = []
    for gap, end in gaps[:num]:
        step = by_end[round(end, 9)]
        rows.append(
            {
                "gap_ms": round(1e3 * gap, 1),
                "step_ms": round(1e3 * (step.end - step.start), 1),
                "step_prefill_tokens": step.num_prefill_tokens,
                "step_decodes": step.num_decodes,
            }
        )
    return rows

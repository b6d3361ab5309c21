"""AsyncScheduler: the scheduler of --async-scheduling (vLLM's AsyncScheduler).

The engine sends step N+1 before step N's output is back (core_svc/engine/batch_queue.py), so a
request whose scheduled tokens reach its end in step N has a token on the way that step N+1
already needs as input. That token is an output placeholder here (`num_output_placeholders`):
the scheduler counts it as known when it builds the next step, the ranks append what they
sampled themselves, and applying step N's output takes the placeholder back. With speculative
decoding a decode's draft slots are placeholders too (vLLM's AsyncScheduler): the next step is
scheduled as if every draft were accepted, the ranks, which know better, start it where their
accepted tokens end, and applying the output rolls num_computed_tokens back by the rejected
ones. What a step in
flight computed for a request that finished, was preempted or aborted meanwhile is dropped.
"""

from __future__ import annotations

from core_svc.sched.scheduler import Scheduler
from core_svc.sched.step_update import ScheduledStep, StepUpdate


class AsyncScheduler(Scheduler):
    """Schedules one step ahead; see the module docstring."""

    max_steps_in_flight = 2

    def _after_schedule(self, scheduled: ScheduledStep) -> None:
        """A request whose scheduled tokens reach its end samples in this step: its token, and
        one per draft slot beyond it, are placeholders until the step's output comes back."""
        for request, num_computed in zip(
            scheduled.requests, scheduled.num_computed_tokens, strict=True
        ):
            num_spec = num_computed - len(request.all_token_ids) - request.num_output_placeholders
            if num_spec >= 0:
                request.num_output_placeholders += 1 + num_spec

    def _after_update(self, update: StepUpdate) -> None:
        """Each sampled token replaces its placeholder; the ranks appended it themselves. A
        request with draft slots gives back all of them, and the ranks appended every token
        they sampled for it (a stop may have ended the request before the last)."""
        for request in update.sampled_reqs:
            request.num_output_placeholders -= 1
            request.num_sent_token_ids += 1
        for request, num_spec, num_sampled in update.spec_reqs:
            request.num_output_placeholders -= num_spec
            request.num_sent_token_ids += num_sampled - 1

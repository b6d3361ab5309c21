"""RankRecovery: bring the worker ranks up again after the engine lost them, and resume.

When a rank dies or hangs, the engine core suspends (EngineCore.on_fault): it stops stepping and
keeps every request, the running ones back in the waiting queue. This runs on the service's event
loop: readiness NOT_SERVING, the failed executor closed, then the whole bring-up again (Describe
until every rank answers, LoadModel under a new owner epoch, KV capacity, InitializeKvCache), a
new executor, and EngineCoreProc.resume: a fresh KV cache, every request scheduled again by
recompute (its prompt and the tokens it generated). Clients see a pause.

`--max-recovery-seconds` bounds it, from the fault to stepping again; past it the engine fails its
requests (clients get UNAVAILABLE) and the service exits non-zero, as without recovery. A fault
of ranks that ran no step since the previous recovery does not restart the clock, so a rank that
keeps failing cannot hold requests forever. The new ranks' first step may take only what is left
of the bound (not the --execute-timeout allowance of a first start): a rank that hangs on it is
noticed, and the recovery given up, at the bound.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from core_svc.engine_core import Fault
from core_svc.engine_loop import EngineCoreProc
from core_svc.grpc_executor import GrpcExecutor
from core_svc.metrics import CoreMetrics
from core_svc.worker_pool import ModelFacts, WorkerBringUpError

logger = logging.getLogger(__name__)

BringUp = Callable[[float], Awaitable[ModelFacts]]
"""Bring the ranks up under a new owner epoch, retrying until the deadline (time.monotonic())."""
OpenExecutor = Callable[[float], GrpcExecutor]
"""Open Execute streams to the ranks; their first step may take at most the given seconds."""


class RecoveryFailed(Exception):
    """The ranks did not come back usable in time."""


class RankRecovery:
    """Recovers the engine from a lost rank; `start` is called on the event loop thread."""

    def __init__(
        self,
        *,
        proc: EngineCoreProc,
        executor: GrpcExecutor,
        bring_up: BringUp,
        open_executor: OpenExecutor,
        set_ready: Callable[[bool], Awaitable[None]],
        metrics: CoreMetrics,
        facts: ModelFacts,
        max_recovery_seconds: float,
    ) -> None:
        self._proc = proc
        self._executor = executor
        self._bring_up = bring_up
        self._open_executor = open_executor
        self._set_ready = set_ready
        self._metrics = metrics
        self._facts = facts
        self.max_recovery_seconds = max_recovery_seconds
        self._deadline = 0.0
        self._task: asyncio.Task[None] | None = None

    @property
    def is_recovering(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self, fault: Fault) -> None:
        """The engine suspended on `fault`: recover in the background (after the recovery
        still finishing, if any)."""
        previous = self._task
        self._task = asyncio.create_task(self._recover(fault, previous), name="rank-recovery")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])

    async def _recover(self, fault: Fault, previous: asyncio.Task[None] | None) -> None:
        if previous is not None:
            await asyncio.wait([previous])
        started = time.monotonic()
        if self._executor.has_stepped or self._deadline == 0.0:
            self._deadline = started + self.max_recovery_seconds
        self._metrics.recoveries[fault.cause].inc()
        logger.warning(
            "recovery started (%s): %s; %d requests kept, stepping paused; waiting up to %.0f s "
            "for the worker ranks",
            fault.cause,
            fault.message,
            self._proc.engine_core.num_requests,
            self._deadline - started,
        )
        await self._set_ready(False)
        await asyncio.to_thread(self._executor.shutdown)
        try:
            executor, num_blocks = await asyncio.wait_for(
                self._bring_up_ranks(), max(0.0, self._deadline - time.monotonic())
            )
        except (TimeoutError, WorkerBringUpError, RecoveryFailed) as err:
            seconds = time.monotonic() - started
            reason = str(err) or f"the worker ranks did not come back within {seconds:.0f} s"
            logger.error("recovery failed after %.1f s: %s", seconds, reason)
            self._proc.give_up(f"the worker ranks could not be brought up again: {reason}")
            return
        self._executor = executor
        num_resumed = await asyncio.wrap_future(self._proc.resume(executor, num_blocks))
        if self._proc.engine_core.is_failed:
            return
        seconds = time.monotonic() - started
        self._metrics.recovery_seconds.observe(seconds)
        self._metrics.requests_resumed.inc(num_resumed)
        logger.warning(
            "recovery finished in %.2f s: %d requests resumed (%d KV blocks)",
            seconds,
            num_resumed,
            num_blocks,
        )
        await self._set_ready(True)

    async def _bring_up_ranks(self) -> tuple[GrpcExecutor, int]:
        facts = await self._bring_up(self._deadline)
        expected = self._facts
        if (facts.vocab_size, facts.max_model_len) != (expected.vocab_size, expected.max_model_len):
            raise RecoveryFailed(
                f"the ranks came back with vocab {facts.vocab_size} and max_model_len "
                f"{facts.max_model_len}, not {expected.vocab_size} and {expected.max_model_len}"
            )
        if facts.num_kv_blocks != expected.num_kv_blocks:
            logger.warning(
                "the KV cache changed from %d to %d blocks",
                expected.num_kv_blocks,
                facts.num_kv_blocks,
            )
        first_step_seconds = max(0.0, self._deadline - time.monotonic())
        return self._open_executor(first_step_seconds), facts.num_kv_blocks

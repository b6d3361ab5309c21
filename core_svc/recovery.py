"""RankRecovery: bring the worker ranks up again after the engine lost them, and resume.

When a rank dies or hangs, the engine core suspends (EngineCore.on_fault): it stops stepping and
keeps every request, the running ones back in the waiting queue. This runs on the service's event
loop: readiness NOT_SERVING, the failed executor closed, then the whole bring-up again (Describe
until every rank answers, LoadModel under a new owner epoch, KV capacity, InitializeKvCache), a
new executor, and EngineInbox.resume: a fresh KV cache, every request scheduled again by
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

from core_svc.assembly import served_model_name
from core_svc.config import CoreConfig
from core_svc.engine.engine_inbox import EngineInbox
from core_svc.executor.abstract import Fault
from core_svc.executor.grpc_executor import GrpcExecutor
from core_svc.executor.step_timeout import StepTimeout
from core_svc.metrics import CoreMetrics
from core_svc.worker_pool import ModelFacts, WorkerBringUpError, WorkerPool

logger = logging.getLogger(__name__)


class RecoveryFailed(Exception):
    """The ranks did not come back usable in time."""


class RankRecovery:
    """Owns the engine's link to its worker ranks: opens the executor that steps them (the
    first one, and a new one after every recovery), and recovers when the engine suspends.
    Its executors report failures to the engine loop's inbox; the loop reports a suspension
    to `on_suspended`, and the recovery answers through the same inbox."""

    def __init__(
        self,
        config: CoreConfig,
        pool: WorkerPool,
        inbox: EngineInbox,
        metrics: CoreMetrics,
        facts: ModelFacts,
        set_ready: Callable[[bool], Awaitable[None]],
    ) -> None:
        self._config = config
        self._pool = pool
        self._inbox = inbox
        self._metrics = metrics
        self._facts = facts
        self._set_ready = set_ready
        self._loop = asyncio.get_running_loop()
        self.max_recovery_seconds = config.max_recovery_seconds
        self._deadline = 0.0
        self._task: asyncio.Task[None] | None = None
        self.executor = self.open_executor()
        """The executor stepping the current ranks."""

    @property
    def is_recovering(self) -> bool:
        return self._task is not None and not self._task.done()

    def open_executor(self, first_step_seconds: float | None = None) -> GrpcExecutor:
        """Execute streams to every rank under the pool's epoch, with a fresh step timeout (new
        ranks get a first-step allowance again: --execute-timeout, or less when given; after a
        recovery, what is left of --max-recovery-seconds)."""
        config = self._config
        first_step = config.execute_timeout
        if first_step_seconds is not None:
            first_step = min(first_step, first_step_seconds)
        executor = GrpcExecutor(
            config.worker_addrs,
            config.world_size - config.options.parallel.tensor_parallel_size,
            StepTimeout(config.step_timeout_floor, config.step_timeout_multiple, first_step),
            self._inbox.executor_failed,
            self._metrics.observe_worker_step,
            self._pool.security,
            self._pool.owner_epoch,
            self._pool.grpc_metrics,
        )
        executor.open()
        return executor

    def on_suspended(self, fault: Fault, num_requests: int) -> None:
        """The engine suspended on `fault`, keeping `num_requests` requests (the loop thread):
        recover on the event loop."""
        self._loop.call_soon_threadsafe(self.start, fault, num_requests)

    def start(self, fault: Fault, num_requests: int) -> None:
        """Recover in the background (after the recovery still finishing, if any); on the
        event loop thread."""
        previous = self._task
        self._task = asyncio.create_task(
            self._recover(fault, num_requests, previous), name="rank-recovery"
        )

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])

    async def _recover(
        self, fault: Fault, num_requests: int, previous: asyncio.Task[None] | None
    ) -> None:
        if previous is not None:
            await asyncio.wait([previous])
        started = time.monotonic()
        if self.executor.has_stepped or self._deadline == 0.0:
            self._deadline = started + self.max_recovery_seconds
        self._metrics.recoveries[fault.cause].inc()
        logger.warning(
            "recovery started (%s): %s; %d requests kept, stepping paused; waiting up to %.0f s "
            "for the worker ranks",
            fault.cause,
            fault.message,
            num_requests,
            self._deadline - started,
        )
        await self._set_ready(False)
        await asyncio.to_thread(self.executor.shutdown)
        try:
            executor, num_blocks = await asyncio.wait_for(
                self._bring_up_ranks(), max(0.0, self._deadline - time.monotonic())
            )
        except (TimeoutError, WorkerBringUpError, RecoveryFailed) as err:
            seconds = time.monotonic() - started
            reason = str(err) or f"the worker ranks did not come back within {seconds:.0f} s"
            logger.error("recovery failed after %.1f s: %s", seconds, reason)
            self._inbox.give_up(f"the worker ranks could not be brought up again: {reason}")
            return
        self.executor = executor
        num_resumed = await asyncio.wrap_future(self._inbox.resume(executor, num_blocks))
        if num_resumed is None:  # the engine failed meanwhile
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
        """The whole bring-up again under a new owner epoch, then a new executor."""
        config = self._config
        self._pool.next_epoch()
        facts = await self._pool.bring_up_with_retries(
            config, served_model_name(config), self._deadline
        )
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
        return self.open_executor(first_step_seconds), facts.num_kv_blocks

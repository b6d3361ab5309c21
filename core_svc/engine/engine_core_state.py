"""What the engine core holds: its configuration, the scheduler, the KV cache, the executor,
its clients' requests and its state flags (vLLM's EngineCore.__init__).

EngineCore is split by concern: this base holds the state and the small queries every part
asks; `engine_core_faults.py` adds suspending, resuming and failing, `engine_core_steps.py`
the step (lockstep or one ahead), and `engine_core.py` the requests' API (add, abort,
admission). They are one object, as the busy loop sees one engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from core_svc.engine.batch_queue import BatchQueue
from core_svc.engine.client_requests import ClientRequests
from core_svc.executor.abstract import Executor, Fault
from core_svc.kv_cache.kv_cache_manager import KVCacheManager
from core_svc.kv_connector.base import KVConnectorScheduler
from core_svc.request import Request
from core_svc.sched.admission import kv_capacity_problem
from core_svc.sched.async_scheduler import AsyncScheduler
from core_svc.sched.scheduler import Scheduler
from core_svc.sched.scheduler_config import CacheConfig, SchedulerConfig
from core_svc.sched.scheduler_stats import make_scheduler_stats
from core_svc.sched.structured_requests import StructuredRequests
from core_svc.structured_output.manager import DEFAULT_STRUCTURED_OUTPUTS, StructuredOutputsConfig
from splitserve_contracts.output_types import ErrorKind, SchedulerStats

logger = logging.getLogger(__name__)


class EngineCoreState:
    """The engine core's state; see `EngineCore` (core_svc/engine/engine_core.py) for its life."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        executor: Executor,
        can_recover: bool = False,
        structured_outputs_config: StructuredOutputsConfig = DEFAULT_STRUCTURED_OUTPUTS,
        wake: Callable[[], None] = lambda: None,
        kv_connector: KVConnectorScheduler | None = None,
    ) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.executor = executor
        self.kv_cache_manager = KVCacheManager(
            num_blocks=cache_config.num_blocks,
            block_size=cache_config.cache.block_size,
            max_model_len=scheduler_config.max_model_len,
            enable_caching=cache_config.cache.enable_prefix_caching,
            sliding_window=cache_config.sliding_window,
            num_state_slots=cache_config.num_state_slots,
        )
        scheduler_class = (
            AsyncScheduler if scheduler_config.scheduler.async_scheduling else Scheduler
        )
        self.scheduler = scheduler_class(
            scheduler_config, cache_config, self.kv_cache_manager, kv_connector
        )
        self.kv_connector = kv_connector
        """Moves KV to and from other engines (--kv-transfer-config; None: none)."""
        self.structured = StructuredRequests(
            scheduler_config.vocab_size,
            structured_outputs_config,
            wake,
            scheduler_config.speculative_config,
            scheduler_config.max_model_len,
        )
        """Requests compiling their grammar, and the steps' grammar bitmasks; `wake` tells
        the busy loop a compile finished."""
        self.clients = ClientRequests()
        """Each client's live requests, and the outputs owed to clients between steps."""
        self.can_recover = can_recover
        self.is_failed = False
        self.failure_message = ""
        self.suspension: Fault | None = None
        """Set while the engine waits for its ranks to come back (suspended)."""
        self.can_step = True
        """Neither failed nor suspended (one flag for the busy loop's checks)."""
        self.is_draining = False
        """Set when the service is shutting down: new requests are refused, running ones
        finish."""
        self._next_req_handle = 1
        self.num_steps_applied = 0
        """Steps whose output was applied (with async scheduling, fewer than step() calls)."""
        self._batch_queue = self._new_batch_queue(executor)
        """Steps in flight, when the scheduler runs ahead (async scheduling)."""

    def _new_batch_queue(self, executor: Executor) -> BatchQueue | None:
        num_steps = self.scheduler.max_steps_in_flight
        return BatchQueue(executor, num_steps) if num_steps > 1 else None

    def _kv_capacity_problem(self, request: Request) -> str | None:
        max_model_len, block_size = (
            self.scheduler_config.max_model_len,
            self.cache_config.cache.block_size,
        )
        num_usable_blocks = self.kv_cache_manager.block_pool.num_usable_blocks
        return kv_capacity_problem(request, max_model_len, block_size, num_usable_blocks)

    def _reject(self, request: Request, kind: ErrorKind, error: str) -> None:
        log = logger.info if kind is ErrorKind.OVERLOADED else logger.warning
        log("refusing request %s: %s", request.request_id[:64], error)
        self.clients.refuse(request, kind, error)

    def make_stats(self) -> SchedulerStats:
        return make_scheduler_stats(self.scheduler, self.kv_cache_manager, self.structured)

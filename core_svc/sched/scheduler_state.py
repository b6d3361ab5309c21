"""What the scheduler knows between steps: its configuration, collaborators, queues and counters.

The scheduler is split along its passes (vLLM's v1/core/sched/ is the model for the room):
this base holds the state every pass reads and writes; `preemption.py`,
`running_pass.py` and `waiting_pass.py` add the passes, and `scheduler.py` the step itself
(schedule, apply the output, finish requests). The passes are methods on one object, not
collaborators, because they share this state on the hot path: a decode-heavy step reads a
dozen of these attributes per request.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from core_svc.kv_cache.block_hash import BlockHasher
from core_svc.kv_cache.kv_cache_manager import KVCacheManager
from core_svc.kv_connector.base import KVConnectorScheduler
from core_svc.request import Request
from core_svc.sched.encoder_scheduler import EncoderScheduler
from core_svc.sched.lora_slots import LoraSlotTable
from core_svc.sched.prefill_policy import PrefillPolicy
from core_svc.sched.request_queue import create_request_queue
from core_svc.sched.scheduler_config import CacheConfig, SchedulerConfig
from core_svc.sched.step_update import ScheduledStep, SpecDecodingStats, StepUpdater


@dataclass(slots=True)
class KVLoadTotals:
    """A KV connector's loads as the ranks reported them (KVConnectorOutput), cumulative."""

    num_bytes: int = 0
    seconds: float = 0.0
    num_loads: int = 0
    num_failed: int = 0


class SchedulerState:
    """The scheduler's state; see `Scheduler` (core_svc/sched/scheduler.py) for its invariants."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        kv_cache_manager: KVCacheManager,
        kv_connector: KVConnectorScheduler | None = None,
    ) -> None:
        options = scheduler_config.scheduler
        self.max_num_seqs = options.max_num_seqs
        self.max_num_batched_tokens = options.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.prefill_policy = PrefillPolicy(scheduler_config)
        """The caps on prompt tokens per step, static or adaptive."""
        self.is_encoder_only = scheduler_config.is_encoder_only
        """Prompts are computed whole, in one step (no chunked prefill)."""
        self.policy = options.policy
        self.enable_caching = cache_config.cache.enable_prefix_caching
        self.kv_cache_manager = kv_cache_manager
        self.block_hasher = BlockHasher(cache_config.cache.block_size)
        budget = scheduler_config.encoder_compute_budget
        self.encoder = EncoderScheduler(budget, budget, options.disable_chunked_mm_input)
        """Encoder inputs of multimodal requests (idle for text-only ones)."""
        self.lora = LoraSlotTable(scheduler_config.lora)
        """The LoRA adapters of the requests and the workers' slots (idle without LoRA)."""
        self._updater = StepUpdater(
            kv_cache_manager,
            self.block_hasher,
            self.encoder,
            max_model_len=self.max_model_len,
            vocab_size=scheduler_config.vocab_size,
        )
        spec = scheduler_config.speculative_config
        self._num_spec_by_batch = spec.num_spec_tokens_for_batch(self.max_num_seqs) if spec else []
        """Draft slots per decoding request by the number of running requests (speculative
        decoding; empty: off)."""
        self.spec_stats = SpecDecodingStats(spec.num_speculative_tokens if spec else 0)
        self.requests: dict[int, Request] = {}
        self.waiting = create_request_queue(options.policy)
        self.running: list[Request] = []
        self.finished_req_handles: list[int] = []
        """Handles the workers know and must drop, sent with the next SchedulerOutput."""
        self.traced_finished: list[Request] = []
        """Traced requests freed since the loop last took them (their spans to build)."""
        self.step_id = 0
        self.num_preemptions = 0
        self.num_waiting_tokens = 0
        """Tokens of the waiting requests (to compute when they are admitted)."""
        self.num_scheduled_tokens = 0
        """Tokens scheduled in the latest step."""
        self.num_prompt_tokens = 0
        """Prompt tokens of the requests that have sampled their first token (vLLM's prompt
        throughput counts a prompt when its first token arrives), since the engine started."""
        self.num_generation_tokens = 0
        """Tokens sampled since the engine started."""
        self.num_structured = 0
        """Requests with a grammar among `requests` (0: steps skip the grammar work)."""
        self.kv_connector = kv_connector
        """Moves KV to and from other engines (None: no --kv-transfer-config; every step then
        skips the transfers' bookkeeping, kv_transfers.py)."""
        self.loading: dict[int, tuple[Request, int]] = {}
        """WAITING_FOR_REMOTE_KVS requests by req_handle, each with the prompt tokens it loads."""
        self.sending: dict[int, Request] = {}
        """Finished requests whose blocks are kept for a peer to pull, by req_handle."""
        self.cancelling: dict[int, Request] = {}
        """Aborted requests whose load the ranks have not reported stopped yet (blocks kept)."""
        self.refused: list[Request] = []
        """Requests the waiting pass failed (their kv_transfer_params); the next applied
        step's outputs tell their clients."""
        self.num_external_queries = 0
        """vLLM's connector prefix-cache queries: with a connector, the tokens beyond the local
        prefix hit of every request admitted (not resumed after a preemption)."""
        self.num_external_hits = 0
        """Prompt tokens the connector loaded."""
        self.kv_loads = KVLoadTotals()
        """What the ranks reported loading from peers."""
        self._in_flight: deque[ScheduledStep] = deque()
        """Scheduled steps whose outputs are not applied yet, oldest first (at most
        `max_steps_in_flight`)."""

"""The SchedulerStats every EngineCoreOutputs carries (vLLM's): the scheduler's queues and
counters, the KV cache's use and prefix-cache hits, and the grammar cache's."""

from __future__ import annotations

from core_svc.kv_cache.kv_cache_manager import KVCacheManager
from core_svc.sched.scheduler import Scheduler
from core_svc.sched.structured_requests import StructuredRequests
from splitserve_contracts.output_types import SchedulerStats


def make_scheduler_stats(
    scheduler: Scheduler, kv_cache_manager: KVCacheManager, structured: StructuredRequests
) -> SchedulerStats:
    pool = kv_cache_manager.block_pool
    prefix_cache_stats = kv_cache_manager.prefix_cache_stats
    running_loras, waiting_loras = scheduler.lora.adapter_names()
    spec = scheduler.spec_stats
    grammars = structured.manager
    loads = scheduler.kv_loads
    state = kv_cache_manager.state_slots
    return SchedulerStats(
        num_running_reqs=len(scheduler.running),
        num_waiting_reqs=len(scheduler.waiting),
        kv_cache_usage=kv_cache_manager.usage,
        prefix_cache_queries=prefix_cache_stats.queries,
        prefix_cache_hits=prefix_cache_stats.hits,
        num_preemptions=scheduler.num_preemptions,
        step_id=scheduler.step_id,
        num_scheduled_tokens=scheduler.num_scheduled_tokens,
        num_used_blocks=pool.get_num_used_blocks(),
        num_total_blocks=pool.num_usable_blocks,
        num_prompt_tokens=scheduler.num_prompt_tokens,
        num_generation_tokens=scheduler.num_generation_tokens,
        encoder_cache_queries=scheduler.encoder.stats.queries,
        encoder_cache_hits=scheduler.encoder.stats.hits,
        num_waiting_tokens=scheduler.num_waiting_tokens,
        running_lora_adapters=running_loras,
        waiting_lora_adapters=waiting_loras,
        num_waiting_deferred=len(structured.compiling),
        spec_decode_num_drafts=spec.num_drafts,
        spec_decode_num_draft_tokens=spec.num_draft_tokens,
        spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
        spec_decode_num_accepted_tokens_per_pos=list(spec.num_accepted_tokens_per_pos),
        # hits read first: a compile thread counts the query before its hit
        structured_output_cache_hits=grammars.num_cache_hits,
        structured_output_cache_queries=grammars.num_cache_queries,
        external_prefix_cache_queries=scheduler.num_external_queries,
        external_prefix_cache_hits=scheduler.num_external_hits,
        num_waiting_for_remote_kvs=len(scheduler.loading),
        num_sending_reqs=len(scheduler.sending),
        kv_transfer_received_bytes=loads.num_bytes,
        kv_transfer_seconds=loads.seconds,
        kv_transfer_num_loads=loads.num_loads,
        kv_transfer_num_failed_loads=loads.num_failed,
        num_used_state_slots=0 if state is None else state.num_held,
        num_total_state_slots=0 if state is None else state.num_usable_slots,
    )

"""The engine core assembled from its parts once the worker ranks' facts are known: the core
service (core_svc/main.py), the in-process engine of the offline `LLM` API
(splitserve/inprocess.py) and the benchmarks build it here, the same way, from the core's
options (CoreConfig: its flags) and what the ranks reported (ModelFacts)."""

from __future__ import annotations

import logging
from dataclasses import replace

from core_svc.config import CoreConfig
from core_svc.engine.engine_core import EngineCore
from core_svc.engine.engine_inbox import EngineInbox
from core_svc.executor.abstract import Executor
from core_svc.kv_connector.factory import create_kv_connector
from core_svc.sched.scheduler_config import CacheConfig, SchedulerConfig
from core_svc.structured_output.manager import StructuredOutputsConfig
from core_svc.worker_pool import ModelFacts
from splitserve_runtime.model_spec import served_model_name as default_served_name

logger = logging.getLogger(__name__)


def served_model_name(config: CoreConfig) -> str:
    """The name clients see: --served-model-name, else the one `--model` implies."""
    return config.served_model_name or default_served_name(config.model)


def scheduler_config(config: CoreConfig, facts: ModelFacts) -> SchedulerConfig:
    """How many requests and tokens one step may carry, and what the model allows."""
    return SchedulerConfig(
        scheduler=config.options.scheduler,
        lora=config.options.lora,
        max_model_len=facts.max_model_len,
        vocab_size=facts.vocab_size,
        max_tokens_per_mm_item=facts.max_tokens_per_mm_item,
        is_pooling=facts.pooler_config is not None,
        is_encoder_only=is_encoder_only(facts),
        speculative_config=config.speculative_config,
    )


def is_encoder_only(facts: ModelFacts) -> bool:
    """Whether the ranks serve an encoder-only pooling model (BERT-style)."""
    return facts.pooler_config is not None and facts.pooler_config.is_encoder_only


def cache_config(config: CoreConfig, facts: ModelFacts) -> CacheConfig:
    """The paged KV cache the ranks allocated; an encoder-only model's blocks hold no KV (its
    attention does not use the cache), so nothing of them is cached for other requests. A model
    with state layers keeps prefix caching off (vLLM's mamba_cache_mode "none"): its state is one
    per request, after its last computed token, not per block, so a cached prefix's blocks
    could not restore it."""
    cache = config.options.cache
    if facts.num_state_slots and cache.enable_prefix_caching:
        logger.info(
            "prefix caching is off for %s: its state layers keep one state per request (after "
            "its last computed token), which cached KV blocks of a prefix cannot restore",
            facts.architecture,
        )
    enable = facts.serves_prefix_caching(cache.enable_prefix_caching)
    cache = replace(cache, enable_prefix_caching=enable)
    return CacheConfig(
        facts.num_kv_blocks, cache, facts.sliding_window, num_state_slots=facts.num_state_slots
    )


def refuse_state_layer_conflicts(config: CoreConfig, facts: ModelFacts) -> None:
    """ValueError for what a model with state layers cannot run with yet: a KV connector
    (its transfers move KV blocks, not the per-request state) and speculative decoding (a
    rejected draft would need the state from before it)."""
    if not facts.num_state_slots:
        return
    if config.options.kv_transfer is not None:
        raise ValueError(
            f"--kv-transfer-config is not supported for {facts.architecture}: its state layers' "
            "per-request state does not travel with KV blocks; serve it without a KV connector"
        )
    if config.speculative_config is not None:
        raise ValueError(
            f"--speculative-config is not supported for {facts.architecture}: its state layers "
            "cannot roll a rejected draft token back; serve it without speculative decoding"
        )


def build_engine(
    config: CoreConfig, facts: ModelFacts, executor: Executor, inbox: EngineInbox
) -> EngineCore:
    """The engine core stepping `executor`; it suspends on a lost rank when recovery is on;
    a grammar compiled off its loop wakes the loop through `inbox`; its KV connector is the one
    the options' kv_transfer names (core_svc/kv_connector/factory.py)."""
    refuse_state_layer_conflicts(config, facts)
    return EngineCore(
        scheduler_config(config, facts),
        cache_config(config, facts),
        executor,
        can_recover=config.max_recovery_seconds > 0,
        structured_outputs_config=StructuredOutputsConfig(
            compile_timeout_s=config.options.structured_outputs.compile_timeout
        ),
        wake=inbox.wake,
        kv_connector=create_kv_connector(
            config.options.kv_transfer, config.options.cache.block_size, config.worker_addrs
        ),
    )

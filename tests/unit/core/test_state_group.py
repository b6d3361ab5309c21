"""The state cache group (a model with state layers): one slot per request, allocated, freed
and preempted with its KV blocks, counted in admission, usage and the scheduler stats."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from core_svc.assembly import cache_config, refuse_state_layer_conflicts
from core_svc.config import CoreConfig
from core_svc.kv_cache.kv_cache_manager import KVCacheManager
from core_svc.sched.scheduler_config import CacheConfig
from core_svc.sched.scheduler_output import SchedulerOutput
from core_svc.worker_pool import ModelFacts
from splitserve_contracts.engine_options_types import KVTransferOptions
from tests.unit.core.fake_executor import make_engine, make_request, run_to_completion


def slots_of(so: SchedulerOutput) -> dict[int, int]:
    """req_handle -> the state slot the step gave it (new and resumed requests)."""
    slots = {r.req_handle: r.state_slot for r in so.scheduled_new_reqs}
    cached = so.scheduled_cached_reqs
    slots.update(zip(cached.resumed_req_handles, cached.resumed_state_slots, strict=True))
    return slots


def test_each_request_holds_its_own_slot_and_the_slots_bound_the_running_requests() -> None:
    engine, executor = make_engine(num_state_slots=3, enable_prefix_caching=False)  # 2 usable
    for handle in range(1, 6):
        engine.add_request(make_request(handle, [handle] * 6, max_tokens=4, ignore_eos=True))
    view = run_to_completion(engine)
    assert all(len(view.tokens[(1, h)]) == 4 for h in range(1, 6))
    holders: dict[int, int] = {}  # slot -> the request holding it
    for so in executor.seen:
        for handle in so.finished_req_handles:
            holders = {s: h for s, h in holders.items() if h != handle}
        for handle, slot in slots_of(so).items():
            assert slot in (1, 2) and slot not in holders, "a slot of its own, never the null"
            holders[slot] = handle
        running = len(so.scheduled_new_reqs) + len(so.scheduled_cached_reqs.req_handles)
        assert running <= 2, "no more requests run than there are slots"
    stats = engine.make_stats()
    assert (stats.num_used_state_slots, stats.num_total_state_slots) == (0, 2)
    assert stats.kv_cache_usage == 0.0


def test_usage_is_the_fuller_groups_and_stats_count_the_slots() -> None:
    engine, _ = make_engine(num_state_slots=3, num_blocks=65, enable_prefix_caching=False)
    engine.add_request(make_request(1, [1, 2, 3], max_tokens=20, ignore_eos=True))
    engine.step()
    stats = engine.make_stats()
    assert (stats.num_used_state_slots, stats.num_total_state_slots) == (1, 2)
    assert stats.num_used_blocks == 1
    assert stats.kv_cache_usage == 0.5, "one of two slots, fuller than 1 of 64 blocks"
    assert engine.kv_cache_manager.group_usages() == {"attention": 1 / 64, "state": 0.5}


def test_a_preempted_request_gives_its_slot_back_and_resumes_with_one() -> None:
    engine, executor = make_engine(num_blocks=7, num_state_slots=9, enable_prefix_caching=False)
    engine.add_request(make_request(1, list(range(8)), max_tokens=8, ignore_eos=True))
    engine.add_request(make_request(2, list(range(100, 108)), max_tokens=8, ignore_eos=True))
    run_to_completion(engine)
    assert engine.make_stats().num_preemptions >= 1
    resumed = [so for so in executor.seen if so.scheduled_cached_reqs.resumed_req_handles]
    assert resumed, "the workload preempts"
    for so in resumed:
        cached = so.scheduled_cached_reqs
        assert len(cached.resumed_state_slots) == len(cached.resumed_req_handles)
        assert all(slot > 0 for slot in cached.resumed_state_slots)
    assert engine.kv_cache_manager.state_slots is not None
    assert engine.kv_cache_manager.state_slots.num_held == 0, "every slot back once all finished"


def test_an_allocation_without_a_free_slot_changes_nothing() -> None:
    kv = KVCacheManager(9, 4, max_model_len=64, enable_caching=False, num_state_slots=2)
    first, second = make_request(1, [1] * 5), make_request(2, [2] * 5)
    first.req_handle, second.req_handle = 1, 2
    assert kv.allocate_slots(first, 5) is not None
    free_blocks = kv.block_pool.get_num_free_blocks()
    assert not kv.can_allocate(second, 5)
    assert kv.allocate_slots(second, 5) is None
    assert kv.block_pool.get_num_free_blocks() == free_blocks and kv.get_state_slot(second) == 0
    slot = kv.get_state_slot(first)
    kv.free(first)
    assert kv.allocate_slots(second, 5) is not None and kv.get_state_slot(second) == slot


def test_the_state_group_refuses_prefix_caching_and_a_single_slot() -> None:
    with pytest.raises(ValueError, match="prefix caching"):
        KVCacheManager(9, 4, max_model_len=64, enable_caching=True, num_state_slots=3)
    with pytest.raises(ValueError, match="num_state_slots"):
        CacheConfig.of(9, num_state_slots=1)


def facts(num_state_slots: int) -> ModelFacts:
    return ModelFacts(
        "GraniteMoeHybridForCausalLM", 100, 64, "float32", "torch", 9, 1 << 20,
        num_state_slots=num_state_slots,
    )  # fmt: skip


def test_a_model_with_state_layers_serves_with_prefix_caching_off_and_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = CoreConfig(worker_addrs=["a"])
    assert config.options.cache.enable_prefix_caching
    with caplog.at_level(logging.INFO, logger="core_svc.assembly"):
        cache = cache_config(config, facts(9))
    assert not cache.cache.enable_prefix_caching and cache.num_state_slots == 9
    assert "prefix caching is off for GraniteMoeHybridForCausalLM" in caplog.text
    assert cache_config(config, facts(0)).cache.enable_prefix_caching


def test_a_kv_connector_with_state_layers_is_refused_by_name() -> None:
    config = CoreConfig(worker_addrs=["a"])
    refuse_state_layer_conflicts(config, facts(9))  # nothing to refuse
    options = replace(config.options, kv_transfer=KVTransferOptions(kv_connector="x"))
    with_connector = CoreConfig(worker_addrs=["a"], options=options)
    with pytest.raises(ValueError, match="--kv-transfer-config is not supported"):
        refuse_state_layer_conflicts(with_connector, facts(9))
    refuse_state_layer_conflicts(with_connector, facts(0))

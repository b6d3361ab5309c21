"""KV that moves between engines, through EngineCore with a GrpcConnector on fake ranks: the
producer keeps a finished prompt's blocks for its consumer, the consumer parks a request while
its prompt's KV arrives, and every path gives the blocks back."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from core_svc.engine.engine_core import EngineCore
from core_svc.kv_connector.handoff import parse_handoff
from core_svc.request import RequestStatus
from splitserve_contracts.kv.v1 import kv_transfer_pb2 as kv_pb2
from splitserve_contracts.output_types import ErrorKind, FinishReason, KVConnectorOutput
from tests.unit.core.fake_executor import ClientView, make_engine, make_request
from tests.unit.core.kv_fakes import (
    BLOCK_SIZE,
    OWN_ID,
    PEER_ID,
    PROMPT,
    KvExecutor,
    consumer_request,
    handoff,
    kv_engine,
)


def assert_idle(engine: EngineCore) -> None:
    stats = engine.make_stats()
    assert (stats.num_used_blocks, stats.kv_cache_usage) == (0, 0.0)
    assert (stats.num_waiting_for_remote_kvs, stats.num_sending_reqs) == (0, 0)
    assert not engine.polls_kv_connector()


def error_of(view: ClientView, handle: int) -> tuple[ErrorKind, str]:
    detail = view.details[(1, handle)][-1]
    assert detail.finish_reason == FinishReason.ERROR
    return detail.error_kind, detail.error_message


# -- producer -------------------------------------------------------------------------------


def test_a_producer_hands_off_its_finished_prompt_and_frees_it_once_pulled() -> None:
    engine, executor, _ = kv_engine("kv_producer")
    engine.add_request(make_request(1, PROMPT, max_tokens=1))
    view = ClientView()
    while engine.has_work():
        view.absorb(engine.step())
    detail = view.details[(1, 1)][-1]
    assert detail.finish_reason == FinishReason.LENGTH
    params = json.loads(detail.kv_transfer_params_json)
    checked = parse_handoff(params, len(PROMPT), BLOCK_SIZE, PEER_ID, time.time())
    stats = engine.make_stats()
    assert (stats.num_sending_reqs, stats.num_used_blocks, stats.num_running_reqs) == (1, 3, 0)
    assert engine.polls_kv_connector() and not engine.has_work()
    [send] = [send for meta in executor.metas for send in meta.sends]
    engine.step()  # an empty step: the ranks may report
    assert executor.seen[-1].total_num_scheduled_tokens == 0
    assert list(send.block_ids) == checked.remote_block_ids
    assert send.transfer_id == checked.transfer_id == params["transfer_id"]
    assert params["remote_engine_id"] == OWN_ID and params["tp_size"] == 1
    assert engine.make_stats().num_used_blocks == 3, "kept until the ranks report the pull"
    executor.report = KVConnectorOutput(finished_sending=[send.req_handle])
    engine.step()
    assert_idle(engine)


def test_a_lease_that_ends_frees_the_blocks_and_releases_the_transfer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine, executor, connector = kv_engine("kv_producer", {"lease_seconds": 5})
    engine.add_request(make_request(1, PROMPT, max_tokens=1))
    while engine.has_work():
        engine.step()
    [send] = [send for meta in executor.metas for send in meta.sends]
    assert connector.lease_seconds == 5.0
    later = time.time() + 6
    monkeypatch.setattr(time, "time", lambda: later)
    engine.step()
    assert list(executor.metas[-1].released_transfer_ids) == [send.transfer_id]
    assert_idle(engine)
    executor.report = KVConnectorOutput(finished_sending=[send.req_handle])  # the rank's word
    engine.step()
    assert_idle(engine)


def test_kv_both_hands_off_only_what_asks_and_never_an_aborted_request() -> None:
    engine, _, _ = kv_engine("kv_both")
    asks = make_request(1, PROMPT, max_tokens=1)
    asks.kv_transfer_params = {"do_remote_decode": True, "do_remote_prefill": False}
    engine.add_request(asks)
    engine.add_request(make_request(2, list(range(30, 40)), max_tokens=1))
    aborted = make_request(3, list(range(60, 70)), max_tokens=1)
    aborted.kv_transfer_params = {"do_remote_decode": True}
    engine.add_request(aborted)
    engine.abort_requests(1, [3])
    view = ClientView()
    while engine.has_work():
        view.absorb(engine.step())
    assert json.loads(view.details[(1, 1)][-1].kv_transfer_params_json)["do_remote_prefill"]
    assert view.details[(1, 2)][-1].kv_transfer_params_json == ""
    stats = engine.make_stats()
    assert (stats.num_sending_reqs, stats.num_used_blocks) == (1, 3)


def test_an_aborted_producer_request_is_freed_at_once_without_a_handoff() -> None:
    engine, _, _ = kv_engine("kv_producer")
    engine.add_request(make_request(1, PROMPT, max_tokens=50))
    view = ClientView()
    view.absorb(engine.step())
    engine.abort_requests(1, [1])
    while engine.has_work():
        view.absorb(engine.step())
    assert (1, 1) not in view.finished
    assert_idle(engine)


# -- consumer -------------------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_consumer_parks_while_loading_and_resumes_at_the_last_prompt_token(
    async_scheduling: bool,
) -> None:
    engine, executor, _ = kv_engine("kv_consumer", async_scheduling=async_scheduling)
    engine.add_request(consumer_request(1))
    engine.add_request(make_request(2, [7, 8, 9], max_tokens=6, ignore_eos=True))
    view = ClientView()
    view.absorb(engine.step())
    [load] = executor.loads()
    stats = engine.make_stats()
    assert (stats.num_waiting_for_remote_kvs, stats.num_waiting_reqs) == (1, 0)
    assert stats.num_running_reqs == 1 and stats.num_used_blocks == 3 + 1
    assert list(load.remote_block_ids) == [50, 51, 52] and len(load.local_block_ids) == 3
    assert (load.transfer_id, load.remote_engine_id) == (handoff(10)["transfer_id"], PEER_ID)
    assert all(new.req_handle != load.req_handle for so in executor.seen
               for new in so.scheduled_new_reqs), "never sent while it loads"  # fmt: skip
    view.absorb(engine.step())
    view.absorb(engine.step())
    assert len(view.tokens.get((1, 2), [])) >= 1, "the others keep stepping"
    executor.pull(load, PROMPT)
    executor.report = KVConnectorOutput(
        finished_recving=[load.req_handle], num_bytes_received=3 * 4096, recv_seconds=0.002
    )
    for _ in range(4):
        view.absorb(engine.step())
        admitted = [n for n in executor.seen[-1].scheduled_new_reqs if n.req_handle == 1]
        if admitted:
            break
    [new] = admitted
    assert new.num_computed_tokens == len(PROMPT) - 1 and new.block_ids == list(
        load.local_block_ids
    )
    assert executor.seen[-1].num_scheduled_tokens[0] == 1
    while engine.has_work():
        view.absorb(engine.step())
    assert len(view.tokens[(1, 1)]) == 3 and view.finished[(1, 1)] == FinishReason.LENGTH
    stats = engine.make_stats()
    # vLLM's counts: every request's tokens beyond its local hit (10 loaded, 3 computed here)
    assert (stats.external_prefix_cache_queries, stats.external_prefix_cache_hits) == (13, 10)
    assert (stats.kv_transfer_received_bytes, stats.kv_transfer_seconds) == (3 * 4096, 0.002)
    assert (stats.kv_transfer_num_loads, stats.kv_transfer_num_failed_loads) == (1, 0)
    assert view.details[(1, 1)][0].num_cached_tokens == len(PROMPT) - 1
    assert view.details[(1, 1)][-1].kv_transfer_params_json == ""
    assert_idle(engine)


def test_a_local_prefix_hit_pulls_only_the_blocks_after_it() -> None:
    engine, executor, _ = kv_engine("kv_consumer")
    engine.add_request(make_request(1, PROMPT, max_tokens=1))
    while engine.has_work():
        engine.step()  # its first two blocks are cached now
    engine.add_request(consumer_request(2))
    engine.step()
    [load] = executor.loads()
    assert list(load.remote_block_ids) == [52] and len(load.local_block_ids) == 1
    assert engine.make_stats().num_used_blocks == 3
    executor.pull(load, PROMPT)
    executor.report = KVConnectorOutput(finished_recving=[load.req_handle])
    view = ClientView()
    for _ in range(10):
        view.absorb(engine.step())
        if not engine.has_work():
            break
    assert len(view.tokens[(1, 2)]) == 3
    stats = engine.make_stats()
    # vLLM's counts: the tokens beyond the local hit of each request (10 computed here, then
    # 2 beyond the cached blocks), the hits those loaded
    assert (stats.external_prefix_cache_queries, stats.external_prefix_cache_hits) == (12, 2)
    assert_idle(engine)


def parked_consumer(role: str = "kv_consumer") -> tuple[EngineCore, KvExecutor, kv_pb2.KvLoad]:
    """A consumer whose request 1 waits for its prompt's KV (the load sent to the ranks)."""
    engine, executor, _ = kv_engine(role)
    engine.add_request(consumer_request(1))
    engine.step()
    [load] = executor.loads()
    return engine, executor, load


def test_a_failed_load_computes_the_prompt_here() -> None:
    engine, executor, load = parked_consumer()
    reasons = ["peer gone"]
    executor.report = KVConnectorOutput(failed_recving=[load.req_handle], failed_reasons=reasons)
    engine.step()
    assert engine.scheduler.requests[1].kv_transfer_params is None
    view = ClientView()
    while engine.has_work():
        view.absorb(engine.step())
    [new] = [n for so in executor.seen for n in so.scheduled_new_reqs]
    assert new.num_computed_tokens == 0 and len(view.tokens[(1, 1)]) == 3
    stats = engine.make_stats()
    assert stats.external_prefix_cache_hits == 0
    assert (stats.kv_transfer_num_loads, stats.kv_transfer_num_failed_loads) == (0, 1)
    assert_idle(engine)


def test_a_failed_load_is_never_asked_of_the_connector_again() -> None:
    """A connector whose source stays broken (it offers the same load again) does not loop."""
    engine, executor, connector = kv_engine("kv_consumer")
    engine.add_request(consumer_request(1))
    engine.step()
    [load] = executor.loads()
    asked = []

    def offers_again(request: Any, num_computed: int) -> tuple[int, bool]:
        asked.append(request.req_handle)
        return request.num_prompt_tokens - num_computed, True

    connector.get_num_new_matched_tokens = offers_again  # type: ignore[method-assign]
    executor.report = KVConnectorOutput(failed_recving=[load.req_handle], failed_reasons=["x"])
    view = ClientView()
    for _ in range(20):
        view.absorb(engine.step())
        if not engine.has_work():
            break
    assert asked == [] and len(view.tokens[(1, 1)]) == 3
    assert_idle(engine)


def test_an_abort_mid_load_keeps_the_blocks_until_the_ranks_stop_writing() -> None:
    engine, executor, load = parked_consumer()
    engine.abort_requests(1, [1])
    assert engine.make_stats().num_used_blocks == 3
    assert engine.make_stats().num_waiting_for_remote_kvs == 0
    view = ClientView()
    view.absorb(engine.step())
    assert (1, 1) not in view.tokens and list(executor.metas[-1].cancelled_loads) == [1]
    engine.step()
    assert engine.make_stats().num_used_blocks == 3 and engine.polls_kv_connector()
    reasons = ["cancelled"]
    executor.report = KVConnectorOutput(failed_recving=[load.req_handle], failed_reasons=reasons)
    engine.step()
    assert_idle(engine)
    assert not engine.has_work()
    stats = engine.make_stats()  # a cancel is neither a load nor a failed one
    assert (stats.kv_transfer_num_loads, stats.kv_transfer_num_failed_loads) == (0, 0)


def test_the_ranks_lost_while_loading_recompute_and_free_everything() -> None:
    engine, _, _ = parked_consumer("kv_both")
    engine.scheduler.requeue_all()
    request = engine.scheduler.requests[1]
    assert request.status == RequestStatus.WAITING and request.kv_transfer_params is None
    assert_idle(engine)


# -- refusals -------------------------------------------------------------------------------

NOW = time.time()


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("do_remote_prefill", 1),
        ("do_remote_decode", "yes"),
        ("remote_num_tokens", 9),
        ("remote_num_tokens", "10"),
        ("remote_block_ids", [50, 51]),
        ("remote_block_ids", [0, 51, 52]),
        ("remote_block_ids", [50, 50, 52]),
        ("remote_block_ids", [50, True, 52]),
        ("remote_block_ids", "50,51,52"),
        ("transfer_id", "xyz"),
        ("transfer_id", "AB" * 16),
        ("lease_expires_at", NOW - 1),
        ("lease_expires_at", "soon"),
        ("remote_engine_id", OWN_ID),
        ("remote_engine_id", ""),
        ("remote_engine_id", 5),
        ("remote_addresses", []),
        ("remote_addresses", ["nohost"]),
        ("remote_addresses", ["a:1", "b:2"]),
        ("tp_size", 2),
    ],
)
def test_every_invalid_handoff_field_is_refused_by_name(key: str, value: object) -> None:
    engine, _, _ = kv_engine("kv_consumer")
    engine.add_request(consumer_request(1, **{key: value}))
    engine.add_request(make_request(2, [1, 2, 3], max_tokens=2))
    view = ClientView()
    while engine.has_work():
        view.absorb(engine.step())
    kind, message = error_of(view, 1)
    assert kind == ErrorKind.INVALID_REQUEST and message.startswith(f"kv_transfer_params.{key}: ")
    assert view.finished[(1, 2)] == FinishReason.LENGTH
    assert_idle(engine)


def test_a_producer_refuses_a_handoff_to_load() -> None:
    engine, _, _ = kv_engine("kv_producer")
    engine.add_request(consumer_request(1))
    view = ClientView()
    while engine.has_work():
        view.absorb(engine.step())
    assert error_of(view, 1)[1].startswith("kv_transfer_params.do_remote_prefill: ")
    assert_idle(engine)


def test_params_that_ask_for_nothing_are_computed_as_today() -> None:
    engine, executor, _ = kv_engine("kv_consumer")
    request = make_request(1, PROMPT, max_tokens=2)
    request.kv_transfer_params = {"do_remote_prefill": False}
    engine.add_request(request)
    view = ClientView()
    while engine.has_work():
        view.absorb(engine.step())
    assert len(view.tokens[(1, 1)]) == 2 and not executor.loads()
    assert_idle(engine)


def test_an_engine_without_a_connector_refuses_kv_transfer_params() -> None:
    engine, _ = make_engine()
    request = make_request(1, PROMPT, max_tokens=2)
    request.kv_transfer_params = {"do_remote_decode": True}
    engine.add_request(request)
    view = ClientView()
    view.absorb(engine.step())
    kind, message = error_of(view, 1)
    assert kind == ErrorKind.INVALID_REQUEST
    assert message == "kv_transfer_params: this engine has no KV connector (--kv-transfer-config)"

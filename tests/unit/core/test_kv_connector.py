"""The engine core's KV connector seam: built from --kv-transfer-config (the engine id the
ranks get, the connector's settings checked), kv_transfer_params read off the wire, the handoff
and the metadata on it, and the busy loop's empty steps while transfers are in progress."""

from __future__ import annotations

import json
import threading
import time

import pytest

from core_svc import convert
from core_svc.config import parse_config
from core_svc.engine.engine_inbox import EngineInbox
from core_svc.engine.engine_loop import EngineCoreProc
from core_svc.kv_connector.factory import create_kv_connector, with_kv_engine_id
from core_svc.kv_connector.grpc_connector import LEASE_POLL_SECONDS, GrpcConnectorScheduler
from core_svc.outputs import EngineCoreOutput, EngineCoreOutputs
from splitserve_contracts.core.v1 import core_service_pb2 as core_pb2
from splitserve_contracts.engine_options_types import EngineOptions, KVTransferOptions
from splitserve_contracts.output_types import ErrorKind, FinishReason, KVConnectorOutput
from tests.fixtures.core_wire import engine_core_outputs_from_proto
from tests.unit.core.fake_executor import ClientView, make_engine, make_request
from tests.unit.core.kv_fakes import ADDRESS, consumer_request, kv_engine

WORKERS = ["--worker-addrs", "h:1"]
GRPC = {"kv_connector": "GrpcConnector", "kv_role": "kv_both"}


def test_no_group_no_connector_and_the_registry_builds_the_grpc_one() -> None:
    assert create_kv_connector(None, 16, ["h:1"]) is None
    connector = create_kv_connector(KVTransferOptions("GrpcConnector", "kv_both"), 16, ["h:1"])
    assert isinstance(connector, GrpcConnectorScheduler)
    assert len(connector.engine_id) == 32 and connector.lease_seconds == 30.0
    assert connector.worker_addresses == ["h:1"]


def test_the_core_chooses_the_engine_id_the_ranks_get() -> None:
    config = parse_config([*WORKERS, "--kv-transfer-config", json.dumps(GRPC)], {})
    assert config.options.kv_transfer is not None
    engine_id = config.options.kv_transfer.kv_engine_id
    assert len(engine_id) == 32 and int(engine_id, 16) >= 0
    named = parse_config(
        [*WORKERS, "--kv-transfer-config", json.dumps(GRPC | {"engine_id": "x"})], {}
    )
    assert named.options.kv_transfer is not None and named.options.kv_transfer.kv_engine_id == "x"
    assert with_kv_engine_id(EngineOptions()) == EngineOptions()


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"lease_seconds": 0}, "kv_connector_extra_config.lease_seconds must be a number > 0"),
        ({"lease_seconds": "1"}, "kv_connector_extra_config.lease_seconds must be a number > 0"),
        ({"shared_memory": "yes"}, "kv_connector_extra_config.shared_memory must be true or false"),
        (
            {"advertise_addresses": ["nohost"]},
            "kv_connector_extra_config.advertise_addresses must be a list of",
        ),
        (
            {"advertise_addresses": ["a:1", "b:2"]},
            "kv_connector_extra_config.advertise_addresses lists 2",
        ),
    ],
)
def test_the_connectors_settings_are_checked_with_the_flags(
    capsys: pytest.CaptureFixture[str], extra: dict[str, object], says: str
) -> None:
    value = GRPC | {"kv_connector_extra_config": extra}
    with pytest.raises(SystemExit):
        parse_config([*WORKERS, "--kv-transfer-config", json.dumps(value)], {})
    assert f"--kv-transfer-config: {says}" in capsys.readouterr().err


def test_advertise_addresses_replace_the_worker_addresses_in_the_handoff() -> None:
    extra = json.dumps({"advertise_addresses": ["pod-0.svc:7001"]})
    transfer = KVTransferOptions("GrpcConnector", "kv_producer", extra, "e")
    connector = create_kv_connector(transfer, 16, ["10.0.0.1:50061"])
    assert connector is not None and connector.worker_addresses == ["pod-0.svc:7001"]


@pytest.mark.parametrize(
    ("text", "params", "problem"),
    [
        ("", None, ""),
        ("{}", None, ""),
        ("null", None, ""),
        ('{"do_remote_decode": true}', {"do_remote_decode": True}, ""),
        ("[1]", None, "kv_transfer_params: expected a JSON object"),
        ("{bad", None, "kv_transfer_params: not JSON"),
    ],
)
def test_kv_transfer_params_are_read_off_the_wire(
    text: str, params: dict[str, object] | None, problem: str
) -> None:
    msg = core_pb2.EngineCoreRequest(
        request_id="r", request_handle=1, prompt_token_ids=[1, 2], max_tokens=2,
        kv_transfer_params_json=text,
    )  # fmt: skip
    request = convert.request_from_proto(msg, client_id=1)
    assert request.kv_transfer_params == params
    assert request.kv_transfer_params_problem.startswith(problem)
    assert bool(request.kv_transfer_params_problem) == bool(problem)
    if problem:
        engine, _, _ = kv_engine("kv_both")
        engine.add_request(request)
        view = ClientView()
        view.absorb(engine.step())
        [detail] = view.details[(1, 1)]
        assert detail.error_kind == ErrorKind.INVALID_REQUEST
        assert detail.error_message.startswith(problem)


def test_the_handoff_and_the_metadata_travel() -> None:
    detail = EngineCoreOutput(1, FinishReason.STOP, kv_transfer_params_json='{"a": 1}')
    outputs = EngineCoreOutputs([1], [1], [5], [detail])
    wire = convert.engine_core_outputs_to_proto(outputs).SerializeToString()
    back = engine_core_outputs_from_proto(core_pb2.EngineCoreOutputs.FromString(wire))
    assert back.details[0].kv_transfer_params_json == '{"a": 1}'
    engine, executor, _ = kv_engine("kv_consumer")
    engine.add_request(consumer_request(1))
    engine.step()
    so = executor.seen[-1]
    assert so.kv_connector_metadata
    msg = convert.scheduler_output_to_proto(so)
    assert msg.kv_connector_metadata == so.kv_connector_metadata
    plain, plain_executor = make_engine()
    plain.add_request(make_request(1, [1, 2, 3]))
    plain.step()
    assert plain_executor.seen[-1].kv_connector_metadata == b""
    assert not convert.scheduler_output_to_proto(plain_executor.seen[-1]).kv_connector_metadata


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_loop_polls_the_ranks_while_a_lease_runs_then_blocks(async_scheduling: bool) -> None:
    """No busy spin: the empty steps come every poll interval (10 ms) while a handoff is to be
    registered, every LEASE_POLL_SECONDS (100 ms) while only its lease is held."""
    engine, executor, connector = kv_engine("kv_producer", async_scheduling=async_scheduling)
    done = threading.Event()

    def sink(client_id: int, outputs: object) -> None:
        if isinstance(outputs, EngineCoreOutputs) and any(d.finish_reason for d in outputs.details):
            done.set()

    proc = EngineCoreProc(engine, EngineInbox(), sink, lambda s, t: None, lambda m: None)
    proc.start()
    try:
        proc.inbox.add_requests(1, [make_request(1, list(range(10)), max_tokens=1)])
        assert done.wait(30)
        first = len(executor.seen)
        time.sleep(0.3)
        num_polls = len(executor.seen) - first
        assert 1 <= num_polls <= 8, num_polls  # ~3 at 100 ms; a spin would do thousands
        assert connector.poll_seconds() == LEASE_POLL_SECONDS
        assert all(so.total_num_scheduled_tokens == 0 for so in executor.seen[first:])
        [send] = [s for meta in executor.metas for s in meta.sends]
        executor.report = KVConnectorOutput(finished_sending=[send.req_handle])
        deadline = time.monotonic() + 30
        while connector.has_pending() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        settled = len(executor.seen)
        time.sleep(0.1)
        assert len(executor.seen) == settled, "nothing pending: the loop blocks"
        assert engine.make_stats().num_used_blocks == 0
    finally:
        proc.stop(30)
    assert ADDRESS in connector.worker_addresses

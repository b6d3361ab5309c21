"""`splitserve serve MODEL --pd P:D` (splitserve/pd.py): P prefill and D decode engines, each with
its --kv-transfer-config (role, own engine id) and a thread share, and smg's command line in PD
mode; what --pd refuses before anything starts."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from splitserve import data_parallel, gateway_process, pd
from splitserve.launcher import parse_args
from tests.unit.plumbing.test_data_parallel import refusal

SERVE = ["tiny", "--pd", "1:2", "--grpc-port", "50051", "--port", "8000"]


def _kv_config(core_flags: list[str]) -> dict[str, object]:
    value: dict[str, object] = json.loads(core_flags[core_flags.index("--kv-transfer-config") + 1])
    return value


def test_each_engine_gets_its_role_its_id_and_a_thread_share() -> None:
    args = parse_args(SERVE, {})
    assert args.data_parallel_size == 3 and str(args.pd) == "1:2"
    engines = [data_parallel.engine_options(args, i, 6, {}) for i in range(3)]
    configs = [_kv_config(list(e.service_flags["core"])) for e in engines]
    assert [(c["kv_role"], c["engine_id"]) for c in configs] == [
        ("kv_producer", "prefill-0"),
        ("kv_consumer", "decode-0"),
        ("kv_consumer", "decode-1"),
    ]
    assert {c["kv_connector"] for c in configs} == {"GrpcConnector"}
    for i, engine in enumerate(engines):
        core = list(engine.service_flags["core"])
        assert core[core.index("--engine-id") + 1] == configs[i]["engine_id"]  # metrics label
        assert engine.service_flags["worker"][-2:] == ["--torch-threads", "2"]  # 6 CPUs / 3
        assert (engine.host, engine.grpc_port, engine.http_port) == ("127.0.0.1", 50051 + i, 0)


def test_the_operators_connector_settings_are_kept_role_and_id_are_the_launchers() -> None:
    given = '{"kv_connector": "GrpcConnector", "kv_connector_extra_config": {"lease_seconds": 5}}'
    args = parse_args([*SERVE, "--kv-transfer-config", given], {})
    core = list(data_parallel.engine_options(args, 2, 6, {}).service_flags["core"])
    assert core.count("--kv-transfer-config") == 2  # the launcher's comes last: it wins
    config = _kv_config(core[core.index("--kv-transfer-config") + 2 :])
    assert config["kv_connector_extra_config"] == {"lease_seconds": 5}
    assert (config["kv_role"], config["engine_id"]) == ("kv_consumer", "decode-1")


def test_the_gateway_runs_in_pd_mode() -> None:
    flags = gateway_process.gateway_flags(
        "0.0.0.0", 8000, 29001, ["127.0.0.1:50051", "127.0.0.1:50052", "0.0.0.0:50053"],
        "cache_aware", "info", "text", 30.0,
    )  # fmt: skip
    flags = pd.gateway_pd_flags(flags, pd.pd_counts("1:2"), ["127.0.0.1:50051",
                                "127.0.0.1:50052", "0.0.0.0:50053"])  # fmt: skip
    assert "--worker-urls" not in flags
    workers = flags[flags.index("--pd-disaggregation") : flags.index("--policy")]
    assert workers == [
        "--pd-disaggregation",
        *("--prefill", "grpc://127.0.0.1:50051"),
        *("--decode", "grpc://127.0.0.1:50052"),
        *("--decode", "grpc://127.0.0.1:50053"),
    ]
    assert flags[flags.index("--policy") + 1] == "cache_aware"


def test_the_real_smg_reads_the_pd_command_line() -> None:
    smg = pytest.importorskip("smg.launch_router")
    flags = gateway_process.gateway_flags(
        "127.0.0.1", 8000, 29001, [], "round_robin", "info", "text", 30.0
    )
    argv = pd.gateway_pd_flags(flags, pd.pd_counts("1:1"), ["127.0.0.1:1", "127.0.0.1:2"])
    parsed = smg.parse_router_args(argv)
    assert parsed.pd_disaggregation and parsed.worker_urls == []
    assert parsed.prefill_urls == [("grpc://127.0.0.1:1", None)]  # no bootstrap port
    assert parsed.decode_urls == ["grpc://127.0.0.1:2"]
    assert parsed.worker_wedge_secs == pd.PREFILL_SILENCE_S  # a long prefill is no wedge


def test_ready_names_the_pd_counts() -> None:
    line = data_parallel.ready_line([_gateway()], "cache_aware", pd.pd_counts("1:2"))
    assert line.startswith("READY http=h:1 router=cache_aware engines=") and line.endswith(
        " pd=1:2"
    )


def _gateway() -> Any:
    return SimpleNamespace(kind="gateway", http_address="h:1", metrics_url="", address="h:1")


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["tiny", "--pd", "1:1", "-dp", "2"], "leave out --data-parallel-size"),
        (["tiny", "--pd", "1:1", "-tp", "2"], "engines of one rank"),
        (["tiny", "--pd", "1:1", "--router", "none"], "--pd needs the gateway"),
        (["tiny", "--pd", "0:1"], "is not P:D"),
        (["tiny", "--pd", "2"], "is not P:D"),
    ],
)
def test_refusals(capsys: pytest.CaptureFixture[str], argv: list[str], said: str) -> None:
    assert said in refusal(capsys, argv)

"""How `splitserve serve --data-parallel-size N` spreads the launcher's settings over its engines
and the gateway (splitserve/data_parallel.py), and what it refuses before starting anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitserve import data_parallel, gateway_process
from splitserve.children import LaunchError
from splitserve.launcher import parse_args

SERVE = ["tiny", "-dp", "2", "--grpc-port", "50051", "--port", "8000", "--api-key", "k"]


def test_engines_behind_the_gateway_get_loopback_ports_ranks_and_events() -> None:
    args = parse_args([*SERVE, "-tp", "2", "--max-model-len", "64"], {})
    engines = [data_parallel.engine_options(args, i, 8, {}) for i in range(2)]
    for i, engine in enumerate(engines):
        assert (engine.host, engine.grpc_port, engine.http_port) == ("127.0.0.1", 50051 + i, 0)
        assert engine.api_key == ""  # the gateway holds it; smg sends none to gRPC engines
        frontend = engine.service_flags["frontend"]
        assert frontend[frontend.index("--data-parallel-rank") + 1] == str(i)
        assert (
            '"enable_kv_cache_events": true' in frontend[frontend.index("--kv-events-config") + 1]
        )
        assert engine.service_flags["worker"][-2:] == ["--torch-threads", "2"]  # 8 CPUs / 4 ranks
        assert engine.service_flags["core"] == ["-tp", "2", "--max-model-len", "64"]
    # Each engine's block of metrics ports (frontend, core, 2 ranks) follows the last one's.
    assert [e.frontend_metrics_port for e in engines] == [9400, 9404]
    assert [e.core_metrics_port for e in engines] == [9401, 9405]
    assert [e.worker_metrics_port for e in engines] == [9402, 9406]


def test_without_a_router_each_engine_takes_the_public_address_and_key() -> None:
    args = parse_args([*SERVE, "--router", "none", "--host", "0.0.0.0", "--torch-threads", "3"], {})
    engine = data_parallel.engine_options(args, 1, 8, {})
    assert (engine.host, engine.grpc_port, engine.http_port, engine.api_key) == (
        "0.0.0.0",
        50052,
        8001,
        "k",
    )
    assert "--kv-events-config" not in engine.service_flags["frontend"]
    assert engine.service_flags["worker"] == ["--torch-threads", "3"]  # as the operator said


def test_an_explicit_kv_events_config_is_left_alone() -> None:
    config = '{"enable_kv_cache_events": false}'
    args = parse_args([*SERVE, "--kv-events-config", config], {})
    frontend = data_parallel.engine_options(args, 0, 2, {}).service_flags["frontend"]
    assert frontend.count("--kv-events-config") == 1 and config in frontend
    args = parse_args(SERVE, {})
    env = {"SPLITSERVE_KV_EVENTS_CONFIG": config}  # the frontends read it themselves
    frontend = data_parallel.engine_options(args, 0, 2, env).service_flags["frontend"]
    assert "--kv-events-config" not in frontend


def test_each_engine_gets_its_own_gpus(tmp_path: Path) -> None:
    env = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert data_parallel.engine_devices(1, 2, 2, "auto", env) == {"CUDA_VISIBLE_DEVICES": "6,7"}
    assert data_parallel.engine_devices(1, 2, 2, "cpu", env) == {}
    with pytest.raises(LaunchError, match="3 engines of 2 ranks need 6 GPUs; 4 are visible"):
        data_parallel.engine_devices(0, 2, 3, "auto", env)
    for i in range(3):
        (tmp_path / f"0000:0{i}:00.0").mkdir()
    assert data_parallel.visible_gpus({}, tmp_path) == ["0", "1", "2"]
    assert data_parallel.visible_gpus({}, tmp_path / "absent") == []


def refusal(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        parse_args(argv, {})
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_refusals_before_anything_starts(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert "numbers its engines" in refusal(capsys, [*SERVE, "-dpr", "1"])
    assert "--http-port -1" in refusal(capsys, ["tiny", "-dp", "2", "--http-port", "-1"])
    monkeypatch.setattr(data_parallel, "is_installed", lambda: False)
    err = refusal(capsys, ["tiny", "-dp", "3"])
    assert "pip install 'splitserve[gateway]'" in err and "--router none" in err
    assert parse_args(["tiny", "-dp", "3", "--router", "none"], {}).data_parallel_size == 3
    assert parse_args(["tiny"], {}).data_parallel_size == 1  # one engine needs no gateway


def test_the_gateways_command_line() -> None:
    flags = gateway_process.gateway_flags(
        "0.0.0.0", 8000, 29001, ["127.0.0.1:50051", "0.0.0.0:50052"], "round_robin",
        "info", "json", 30.0,
    )  # fmt: skip
    workers = flags[flags.index("--worker-urls") + 1 : flags.index("--policy")]
    assert workers == ["grpc://127.0.0.1:50051", "grpc://127.0.0.1:50052"]
    assert flags[flags.index("--policy") + 1] == "round_robin"
    assert flags[flags.index("--log-level") + 1] == "warn" and "--log-json" in flags
    assert "k" not in flags  # the API key travels in the environment

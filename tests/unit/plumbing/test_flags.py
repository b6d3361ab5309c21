"""Flags with SPLITSERVE_* environment fallbacks, parsed once."""

from __future__ import annotations

import pytest

from core_svc.config import parse_config as parse_core
from frontend_svc.config import parse_config as parse_frontend
from worker_svc.config import parse_config as parse_worker

WORKERS = "127.0.0.1:1,127.0.0.1:2"


def test_environment_fills_what_the_command_line_leaves_out() -> None:
    env = {
        "SPLITSERVE_MAX_NUM_SEQS": "12",
        "SPLITSERVE_ENABLE_PREFIX_CACHING": "false",
        "SPLITSERVE_WORKER_ADDRS": WORKERS,
        "SPLITSERVE_TENSOR_PARALLEL_SIZE": "2",
    }
    config = parse_core(["--max-model-len", "99"], env)
    assert (config.options.scheduler.max_num_seqs, config.options.model.max_model_len) == (12, 99)
    assert config.options.cache.enable_prefix_caching is False
    assert config.worker_addrs == WORKERS.split(",")
    assert config.options.parallel.distributed_init_method == "tcp://127.0.0.1:29500"


def test_command_line_wins_over_environment() -> None:
    config = parse_core(
        ["--worker-addrs", "h:1", "--max-num-seqs", "3"], {"SPLITSERVE_MAX_NUM_SEQS": "12"}
    )
    assert config.options.scheduler.max_num_seqs == 3


def test_vllm_short_forms_and_layout_check() -> None:
    assert (
        parse_core(
            ["--tp", "2", "--worker-addrs", WORKERS], {}
        ).options.parallel.tensor_parallel_size
        == 2
    )
    config = parse_core(["--tp", "2", "--enable-expert-parallel", "--worker-addrs", WORKERS], {})
    assert config.options.parallel.enable_expert_parallel is True
    assert (
        parse_core(
            ["--tp", "2", "--worker-addrs", WORKERS], {}
        ).options.parallel.enable_expert_parallel
        is False
    )
    with pytest.raises(SystemExit):
        parse_core(["--tp", "2", "--pp", "2", "--worker-addrs", WORKERS], {})


def test_bad_environment_values_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_worker([], {"SPLITSERVE_PORT": "not-a-port"})
    assert "SPLITSERVE_PORT" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_core(["--worker-addrs", "h:1"], {"SPLITSERVE_ENABLE_PREFIX_CACHING": "maybe"})


def test_metrics_port_minus_one_disables_metrics() -> None:
    assert parse_frontend(["--metrics-port", "-1"], {}).metrics_port is None
    assert parse_worker([], {"SPLITSERVE_METRICS_PORT": "9999"}).metrics_port == 9999

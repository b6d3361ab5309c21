"""`splitserve serve`'s (and `up`'s) metrics ports: stable defaults, settable (command line,
--config, environment), free when 0, off when -1; the launcher's own flags, never passed on."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from splitserve.children import StackOptions, connect_host
from splitserve.launcher import build_parser, parse_args
from splitserve_runtime.services import CORE, FRONTEND, WORKER


def metrics_port(args: argparse.Namespace, kind: str, free_port: int, rank: int = 0) -> int:
    """The --metrics-port the launcher gives a child, as `splitserve up` parsed `args`."""
    return StackOptions.from_args(args).metrics_port(kind, free_port, rank)


def test_defaults_are_the_services_stable_ports() -> None:
    args = parse_args([], {})
    assert metrics_port(args, "frontend", 55555) == FRONTEND.default_metrics_port == 9400
    assert metrics_port(args, "core", 55555) == CORE.default_metrics_port == 9401
    assert [metrics_port(args, "worker", 55555, rank) for rank in range(4)] == [
        9402,
        9403,
        9404,
        9405,
    ]
    assert WORKER.default_metrics_port == 9402


def test_set_free_and_off() -> None:
    argv = ["tiny", "--frontend-metrics-port", "0", "--core-metrics-port", "-1"]
    argv += ["--worker-metrics-port", "19500", "--max-model-len", "64"]
    args = parse_args(argv, {})
    # None of them reaches a service (the launcher sets each child's --metrics-port itself).
    assert args.service_flags == {"core": ["--max-model-len", "64"], "frontend": [], "worker": []}
    assert args.model == "tiny"
    assert metrics_port(args, "frontend", 55555) == 55555  # 0: the free port found
    assert metrics_port(args, "core", 55555) == -1  # off
    assert metrics_port(args, "worker", 55555, 1) == 19501
    # A stack started without these settings (tests, the offline LLM): free ports.
    assert StackOptions("tiny").metrics_port("worker", 44444, 3) == 44444


def test_environment_and_config_file_set_them_too(tmp_path: Path) -> None:
    args = parse_args([], {"SPLITSERVE_CORE_METRICS_PORT": "19401"})
    assert metrics_port(args, "core", 55555) == 19401
    config = tmp_path / "serve.yaml"
    config.write_text("worker_metrics_port: 19600\nfrontend-metrics-port: -1\n")
    args = parse_args(["--config", str(config)], {})
    assert metrics_port(args, "worker", 55555, 2) == 19602
    assert metrics_port(args, "frontend", 55555) == -1


def test_no_prefix_of_them_is_accepted() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--core-metrics", "19401"], {})


def test_help_shows_each_default_once() -> None:
    text = " ".join(build_parser()[0].format_help().split())
    for spec in (FRONTEND, CORE, WORKER):
        assert f"(default: {spec.default_metrics_port})" in text
    assert text.count("(default: 9400)") == 1


def test_urls_name_where_the_service_listens() -> None:
    assert connect_host("0.0.0.0") == "127.0.0.1"
    assert connect_host("127.0.0.1") == "127.0.0.1"
    assert connect_host("192.0.2.7") == "192.0.2.7"

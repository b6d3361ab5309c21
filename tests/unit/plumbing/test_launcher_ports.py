"""`splitserve up`'s metrics ports: stable defaults, settable, free when 0, off when -1."""

from __future__ import annotations

import argparse

from splitserve.children import connect_host, metrics_port
from splitserve.launcher import build_parser
from splitserve_runtime.services import CORE, FRONTEND, WORKER


def test_defaults_are_the_services_stable_ports() -> None:
    args, _ = build_parser().parse_known_env([], {})
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
    argv = ["--frontend-metrics-port", "0", "--core-metrics-port", "-1"]
    argv += ["--worker-metrics-port", "19500"]
    args, core_flags = build_parser().parse_known_env(argv, {})
    assert core_flags == []  # none of them leaks to the engine core
    assert metrics_port(args, "frontend", 55555) == 55555  # 0: the free port found
    assert metrics_port(args, "core", 55555) == -1  # off
    assert metrics_port(args, "worker", 55555, 1) == 19501
    # A stack started without these settings (tests, the offline LLM): free ports.
    assert metrics_port(argparse.Namespace(), "worker", 44444, 3) == 44444


def test_environment_sets_them_too() -> None:
    args, _ = build_parser().parse_known_env([], {"SPLITSERVE_CORE_METRICS_PORT": "19401"})
    assert metrics_port(args, "core", 55555) == 19401


def test_urls_name_where_the_service_listens() -> None:
    assert connect_host("0.0.0.0") == "127.0.0.1"
    assert connect_host("127.0.0.1") == "127.0.0.1"
    assert connect_host("192.0.2.7") == "192.0.2.7"

"""The three services as processes: health, reflection, SIGTERM, fatal errors, CLI, launcher."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.loopback_ports import free_ports
from splitserve_runtime.services import SERVICES
from tests.e2e.stack import UP_ANY_METRICS_PORTS, Stack

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


def health(addr: str, service: str) -> int:
    with grpc.insecure_channel(addr) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
        return int(reply.status)


def grpcurl_list(addr: str) -> list[str]:
    exe = shutil.which("grpcurl", path=str(BIN)) or shutil.which("grpcurl")
    if exe is None:
        pytest.skip("grpcurl is not installed")
    out = subprocess.run(
        [exe, "-plaintext", addr, "list"], capture_output=True, text=True, timeout=30, check=True
    )
    return out.stdout.split()


def test_every_service_answers_health_and_reflection(stack: Stack) -> None:
    """Reflection: on the public frontend by default, off on the internal services."""
    serving = health_pb2.HealthCheckResponse.SERVING
    for child in stack.children:
        service = SERVICES[child.kind].grpc_service
        if child.kind == "frontend":
            assert service in grpcurl_list(child.address), child.name
            assert "grpc.health.v1.Health" in grpcurl_list(child.address)
        else:
            with pytest.raises(subprocess.CalledProcessError):
                grpcurl_list(child.address)
        assert health(child.address, "") == serving, child.name
        assert health(child.address, service) == serving, child.name


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _wait_serving(addr: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if health(addr, "") == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            time.sleep(0.2)
    raise AssertionError(f"{addr} never became SERVING")


def test_sigterm_stops_a_service_gracefully_with_exit_0() -> None:
    port, metrics = free_ports(2)
    worker = _spawn(
        "worker_svc", "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics)
    )
    try:
        _wait_serving(f"127.0.0.1:{port}")
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0
    finally:
        worker.kill()


def test_a_fatal_error_exits_non_zero_with_a_clear_message() -> None:
    port, metrics, dead = free_ports(3)
    core = _spawn(
        "core_svc",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--metrics-port",
        str(metrics),
        "--worker-addrs",
        f"127.0.0.1:{dead}",
        "--worker-connect-timeout",
        "2",
    )
    out, _ = core.communicate(timeout=60)
    assert core.returncode == 1
    assert f"worker rank 0 at 127.0.0.1:{dead} unreachable" in out


@pytest.mark.parametrize(
    "command",
    [[], ["serve"], ["up"], ["frontend"], ["core"], ["worker"], ["generate"], ["bench", "serve"]],
)
def test_every_command_has_help(command: list[str]) -> None:
    result = subprocess.run(
        [str(BIN / "splitserve"), *command, "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout


def test_launcher_ready_line_and_sigterm(tiny_model_dir: Path) -> None:
    env = dict(os.environ, SPLITSERVE_LOG_LEVEL="warning")
    # Ports chosen here stand in for the stable defaults (9400, 9401, 9402 + rank).
    fe_metrics, core_metrics, worker_metrics = free_ports(3)
    up = subprocess.Popen(
        [
            str(BIN / "splitserve"),
            "up",
            "--model",
            str(tiny_model_dir),
            "--port",
            "0",
            "--http-port",
            "0",
            "--kv-cache-memory-bytes",
            "16777216",
            *("--frontend-metrics-port", str(fe_metrics)),
            *("--core-metrics-port", str(core_metrics)),
            *("--worker-metrics-port", str(worker_metrics)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        assert up.stdout is not None
        line = up.stdout.readline()
        match = re.fullmatch(
            r"READY frontend=(\S+) core=(\S+) workers=(\S+) metrics=(\S+) http=(\S+)\n", line
        )
        assert match, line
        # workers, core, frontend: each URL the port asked for, where it answers
        urls = match.group(4).split(",")
        ports = [worker_metrics, core_metrics, fe_metrics]
        assert urls == [f"http://127.0.0.1:{port}/metrics" for port in ports]
        for url in urls:
            with urllib.request.urlopen(url, timeout=10) as reply:
                assert reply.status == 200 and b"# TYPE " in reply.read()
            with pytest.raises(urllib.error.HTTPError) as not_found:
                urllib.request.urlopen(url.removesuffix("metrics") + "healthz", timeout=10)
            assert not_found.value.code == 404
        assert health(match.group(1), SERVICES["frontend"].grpc_service) == 1
        with urllib.request.urlopen(f"http://{match.group(5)}/health", timeout=10) as reply:
            assert reply.status == 200
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
        with pytest.raises(grpc.RpcError):
            health(match.group(2), "")
    finally:
        up.kill()


def test_a_dying_child_takes_the_launcher_down_naming_it(tiny_model_dir: Path) -> None:
    result = subprocess.run(
        [
            str(BIN / "splitserve"),
            "up",
            "--model",
            str(tiny_model_dir),
            "--port",
            "0",
            "--http-port",
            "0",
            "--gpu-memory-utilization",  # well typed, so only the core's own check refuses it
            "2",
            *UP_ANY_METRICS_PORTS,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "core exited with code 2" in result.stderr

"""VLLM_CPU_OMP_THREADS_BIND (worker_svc/cpu_binding.py): values checked at start-up with a clear
error, each rank's CPUs, and a spawned worker whose every thread LoadModel binds."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from splitserve.children import StackOptions, _worker_binding
from splitserve.data_parallel import _unbound
from splitserve.loopback_ports import free_ports
from splitserve_contracts.worker.v1 import worker_service_pb2 as pb
from splitserve_contracts.worker.v1 import worker_service_pb2_grpc as pb_grpc
from tests.fixtures.checkpoints import CheckpointCache
from tests.fixtures.load_requests import load_request
from worker_svc.config import parse_config
from worker_svc.cpu_binding import OMP_THREADS_BIND_ENV, auto_cpus, check_bind, rank_cpus

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("value", ["auto", "all", "nobind", "0-1", "0-1|2-3", "0,2-3|4"])
def test_vllm_values_are_accepted(value: str) -> None:
    assert check_bind(value) == value


@pytest.mark.parametrize(
    ("value", "why"),
    [("cores", "'cores' is not a CPU id"), ("0-1|x", "rank 1's CPUs"), ("3-1", "ends before")],
)
def test_a_bad_value_fails_start_up_saying_why(
    value: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_config([], {OMP_THREADS_BIND_ENV: value})
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert OMP_THREADS_BIND_ENV in error and why in error and "0-3|4-7" in error


def test_each_rank_gets_its_list() -> None:
    allowed = list(range(8))
    assert rank_cpus("0-1,6|2-3", 0, 2, allowed) == [0, 1, 6]
    assert rank_cpus("0-1|2-3", 1, 2, allowed) == [2, 3]
    assert rank_cpus("all", 1, 2, allowed) is None
    with pytest.raises(ValueError, match="lists CPUs for 2 ranks; this is rank 2"):
        rank_cpus("0-1|2-3", 2, 3, allowed)
    with pytest.raises(ValueError, match=r"CPUs \[9\] are not among"):
        rank_cpus("8-9", 0, 1, list(range(10))[:9])


def test_auto_keeps_a_cpu_for_core_and_frontend_where_ranks_can_spare_it() -> None:
    assert auto_cpus(range(8), 0, 1) == ([0, 1, 2, 3, 4, 5, 6], [7])
    assert auto_cpus(range(8), 1, 2) == ([3, 4, 5], [7])
    assert auto_cpus([0, 1], 0, 1) == ([0, 1], [])  # two CPUs: the rank keeps both
    assert auto_cpus([0, 1], 1, 2) == ([1], [])
    with pytest.raises(ValueError, match="leave rank 2 none"):
        auto_cpus([0, 1], 2, 3)


def test_the_launcher_binds_its_ranks_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(OMP_THREADS_BIND_ENV, raising=False)
    assert _worker_binding(StackOptions("m"))[OMP_THREADS_BIND_ENV] == "auto"
    given = StackOptions("m", worker_env={OMP_THREADS_BIND_ENV: "all"})
    assert _worker_binding(given)[OMP_THREADS_BIND_ENV] == "all"
    monkeypatch.setenv(OMP_THREADS_BIND_ENV, "0-1")
    assert OMP_THREADS_BIND_ENV not in _worker_binding(StackOptions("m"))  # inherited as set


def thread_cpus(pid: int) -> set[str]:
    """Cpus_allowed_list of every thread of `pid`."""
    lists = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except FileNotFoundError:
            continue  # the thread ended meanwhile
        for line in status.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                lists.add(line.split(":", 1)[1].strip())
    return lists


def wait_described(stub: pb_grpc.WorkerServiceStub, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert process.poll() is None, "the worker exited"
        try:
            stub.Describe(pb.DescribeRequest(), timeout=2)
            return
        except grpc.RpcError:
            assert time.monotonic() < deadline, "the worker never answered"
            time.sleep(0.2)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pick one")
def test_load_model_binds_every_thread_of_a_spawned_worker(
    worker_checkpoints: CheckpointCache,
) -> None:
    cpu = max(os.sched_getaffinity(0))
    (port,) = free_ports(1)
    env = {**os.environ, OMP_THREADS_BIND_ENV: f"{cpu}"}
    argv = [sys.executable, "-m", "worker_svc", "--port", str(port), "--metrics-port", "-1"]
    process = subprocess.Popen(
        [*argv, "--device", "cpu"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            wait_described(stub, process)
            assert len(thread_cpus(process.pid) - {str(cpu)}) > 0  # not bound before LoadModel
            model = worker_checkpoints.get("llama")
            stub.LoadModel(load_request(model_path=str(model), block_size=4), timeout=60)
            assert thread_cpus(process.pid) == {str(cpu)}
            stub.InitializeKvCache(pb.InitializeKvCacheRequest(num_blocks=8), timeout=60)
            assert thread_cpus(process.pid) == {str(cpu)}  # threads started since inherit it
    finally:
        process.terminate()
        log, _ = process.communicate(timeout=30)
    assert f"rank 0 bound to CPUs {cpu}, 1 torch threads" in log.decode()


def test_data_parallel_engines_stay_unbound_unless_told() -> None:
    assert _unbound({}) == {OMP_THREADS_BIND_ENV: "all"}  # auto would stack every engine
    assert _unbound({OMP_THREADS_BIND_ENV: "0-1|2-3"}) == {}

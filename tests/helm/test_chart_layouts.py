"""Worker layouts: perRank (one pod per rank) and tpGroup (one pod per pipeline stage holding its
TP ranks as processes), each as a StatefulSet or as a LeaderWorkerSet. The engine core's
--worker-addrs must name every rank, in rank order, at an address that resolves (as cluster DNS
would) to the pod and process holding it; a TP group stays inside one pod in tpGroup; GPUs follow
the ranks; and the tpGroup supervisor restarts its TP group as a whole."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helm.chart_render import (
    CI_DIR,
    CLUSTER_DOMAIN,
    Doc,
    Manifests,
    Process,
    container_processes,
    flag_value,
    only_container,
    pod_labels,
    pod_template,
    render,
    render_values_file,
)

LAYOUTS = ["perRank", "tpGroup"]
SHAPES = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2)]


@dataclass(frozen=True)
class WorkerPod:
    name: str
    host: str  # the fully qualified DNS name the core dials
    container: Doc
    processes: list[Process]


def worker_pods(m: Manifests) -> list[WorkerPod]:
    """The worker pods the controller creates, with the DNS names they get."""
    workload = m.workload("worker")
    name = workload["metadata"]["name"]
    if workload["kind"] == "StatefulSet":
        service = m.get("Service", workload["spec"]["serviceName"])
        # Names resolve before the ranks are ready: the core loads the model as they start.
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["publishNotReadyAddresses"] is True
        selector = service["spec"]["selector"]
        assert all(pod_labels(workload).get(k) == v for k, v in selector.items())
        names = [f"{name}-{i}" for i in range(workload["spec"]["replicas"])]
        subdomain = service["metadata"]["name"]
    else:
        # One LWS group: leader "<lws>-0", workers "<lws>-0-<i>", under the headless Service
        # "<lws>" that the LWS controller creates (so the chart must not create one).
        assert workload["kind"] == "LeaderWorkerSet"
        assert workload["spec"]["replicas"] == 1
        assert workload["spec"]["networkConfig"]["subdomainPolicy"] == "Shared"
        assert name not in {s["metadata"]["name"] for s in m.of_kind("Service")}
        size = workload["spec"]["leaderWorkerTemplate"]["size"]
        names = [f"{name}-0"] + [f"{name}-0-{i}" for i in range(1, size)]
        subdomain = name
    container = only_container(workload)
    return [
        WorkerPod(
            pod,
            f"{pod}.{subdomain}.{m.namespace}.svc.{CLUSTER_DOMAIN}",
            container,
            container_processes(container),
        )
        for pod in names
    ]


def resolve(pods: list[WorkerPod], address: str) -> tuple[int, int]:
    """(pod index, local rank) of the process listening at a HOST:PORT the core dials."""
    host, port = address.rsplit(":", 1)
    found = [i for i, pod in enumerate(pods) if pod.host == host]
    assert len(found) == 1, f"{host} does not resolve to one worker pod"
    pod = pods[found[0]]
    listening = [i for i, p in enumerate(pod.processes) if flag_value(p.argv, "--port") == port]
    assert len(listening) == 1, f"no one process of {pod.name} listens on {port}"
    declared = {p["containerPort"]: p["name"] for p in pod.container["ports"]}
    local = listening[0]
    assert declared.get(int(port)) == ("grpc" if local == 0 else f"grpc-{local}")
    return found[0], local


def values_for(layout: str, tp: int, pp: int, lws: bool, gpu: bool = False) -> dict[str, Any]:
    return {
        "parallelism": {"tensorParallelSize": tp, "pipelineParallelSize": pp},
        "worker": {"layout": layout, "leaderWorkerSet": {"enabled": lws}, "gpu": {"enabled": gpu}},
    }


def check_rank_wiring(m: Manifests, layout: str) -> list[WorkerPod]:
    core_args = only_container(m.workload("core"))["args"]
    tp = int(flag_value(core_args, "--tensor-parallel-size") or 0)
    pp = int(flag_value(core_args, "--pipeline-parallel-size") or 0)
    per_pod = tp if layout == "tpGroup" else 1
    pods = worker_pods(m)
    assert len(pods) == tp * pp // per_pod
    addrs = (flag_value(core_args, "--worker-addrs") or "").split(",")
    assert len(addrs) == tp * pp and len(set(addrs)) == tp * pp
    for rank, address in enumerate(addrs):
        # rank = pp_rank * tp + tp_rank; tpGroup: pod = pp_rank, local rank = tp_rank.
        assert resolve(pods, address) == (rank // per_pod, rank % per_pod), (rank, address)
    for pod in pods:
        assert len(pod.processes) == per_pod
        ports = [flag_value(p.argv, "--port") for p in pod.processes]
        metrics = [flag_value(p.argv, "--metrics-port") for p in pod.processes]
        assert len(set(ports + metrics)) == 2 * per_pod
        declared = {str(p["containerPort"]) for p in pod.container["ports"]}
        assert set(ports + metrics) <= declared
    # torch.distributed: rank 0 (local rank 0 of pod 0) opens the store on the "dist" port.
    init = flag_value(core_args, "--distributed-init-method") or ""
    host, port = init.removeprefix("tcp://").rsplit(":", 1)
    assert host == pods[0].host
    dist = next(p for p in pods[0].container["ports"] if p["name"] == "dist")
    assert dist["containerPort"] == int(port)
    annotations = pod_template(m.workload("worker"))["metadata"]["annotations"]
    assert annotations["splitserve.io/parallelism"] == f"tp={tp},pp={pp},layout={layout}"
    return pods


@pytest.mark.parametrize("lws", [False, True], ids=["statefulset", "leaderworkerset"])
@pytest.mark.parametrize(("tp", "pp"), SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_rank_is_addressed_in_rank_order(layout: str, tp: int, pp: int, lws: bool) -> None:
    m = render(values_for(layout, tp, pp, lws))
    assert m.workload("worker")["kind"] == ("LeaderWorkerSet" if lws else "StatefulSet")
    check_rank_wiring(m, layout)


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpus_follow_the_ranks(layout: str, gpu: bool) -> None:
    m = render(values_for(layout, 4, 2, lws=False, gpu=gpu))
    container = only_container(m.workload("worker"))
    per_pod = 4 if layout == "tpGroup" else 1
    resources = container["resources"]
    if not gpu:
        assert "nvidia.com/gpu" not in {**resources.get("requests", {}), **resources["limits"]}
        assert all(not p.env for p in container_processes(container))
        return
    assert resources["requests"]["nvidia.com/gpu"] == per_pod
    assert resources["limits"]["nvidia.com/gpu"] == per_pod
    visible = [p.env.get("CUDA_VISIBLE_DEVICES") for p in container_processes(container)]
    # Each rank drives the GPU of its local rank; all GPUs are in the one container, so NCCL
    # reaches the peers over NVLink (a GPU per container would hide them from each other).
    assert visible == ([str(i) for i in range(per_pod)] if per_pod > 1 else [None])


def test_auto_layout_is_tp_group_on_gpus_and_per_rank_on_cpu() -> None:
    for gpu, layout in ((False, "perRank"), (True, "tpGroup")):
        m = render(values_for("auto", 2, 2, lws=False, gpu=gpu))
        check_rank_wiring(m, layout)


@pytest.mark.parametrize(
    ("values_file", "layout", "pods", "ranks_per_pod", "gpus"),
    [
        ("cpu-values.yaml", "perRank", 2, 1, 0),
        ("cpu-pp2-hostpath-values.yaml", "perRank", 2, 1, 0),
        ("cpu-tpgroup-values.yaml", "tpGroup", 2, 2, 0),
        ("gpu-tp2-pp2-values.yaml", "tpGroup", 2, 2, 2),
        ("gpu-lws-hub-values.yaml", "tpGroup", 2, 8, 8),
    ],
)
def test_ci_values_files_lay_out_their_ranks(
    values_file: str, layout: str, pods: int, ranks_per_pod: int, gpus: int
) -> None:
    m = render_values_file(CI_DIR / values_file)
    found = check_rank_wiring(m, layout)
    assert len(found) == pods
    assert {len(p.processes) for p in found} == {ranks_per_pod}
    limits = found[0].container["resources"]["limits"]
    assert limits.get("nvidia.com/gpu", 0) == gpus


def test_leader_worker_set_settings_come_from_values() -> None:
    values = values_for("tpGroup", 8, 4, lws=True, gpu=True)
    values["worker"]["leaderWorkerSet"].update(
        restartPolicy="None",
        startupPolicy="LeaderReady",
        annotations={"leaderworkerset.sigs.k8s.io/exclusive-topology": "kubernetes.io/hostname"},
    )
    lws = render(values).workload("worker")
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 4  # one pod (node) per pipeline stage
    assert group["restartPolicy"] == "None"
    assert lws["spec"]["startupPolicy"] == "LeaderReady"
    assert lws["metadata"]["annotations"] == {
        "leaderworkerset.sigs.k8s.io/exclusive-topology": "kubernetes.io/hostname"
    }
    assert "leaderTemplate" not in group  # the leader is a worker pod like the others


def test_long_release_names_keep_leader_worker_set_pod_names_valid() -> None:
    name = "a-really-long-release-name-for-a-very-large-model-deployment"
    m = render(values_for("perRank", 8, 2, lws=True), name=name)
    for pod in worker_pods(m):
        assert len(pod.name) <= 63, pod.name
        assert all(len(label) <= 63 for label in pod.host.split("."))


@pytest.mark.parametrize(
    ("worker", "message"),
    [
        ({"port": 9400, "metricsPort": 9402}, "overlap"),
        ({"port": 50071, "metricsPort": 9402, "distributedPort": 50073}, "distributedPort"),
    ],
)
def test_colliding_rank_ports_are_refused(worker: dict[str, int], message: str) -> None:
    values = values_for("tpGroup", 4, 1, lws=False)
    values["worker"].update(worker)
    with pytest.raises(Exception, match=message):
        render(values)


# -- the tpGroup supervisor: the recovery model of a TP group --------------------------------


@functools.cache
def supervisor_command() -> tuple[str, ...]:
    """The tpGroup worker container's command: bash -c SCRIPT tp-group (then the ranks);
    rendered once for the module's tests."""
    container = only_container(render(values_for("tpGroup", 2, 1, lws=False)).workload("worker"))
    command = tuple(container["command"])
    assert command[:2] == ("bash", "-c")
    return command


def rank(pid_file: Path, then: str) -> list[str]:
    """A stand-in rank: records its PID, then runs `then`."""
    return ["sh", "-c", f"echo $$ > {pid_file}; {then}"]


def is_running(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text()), 0)
    except ProcessLookupError:
        return False
    return True


def wait_for(paths: list[Path], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() and p.read_text().strip() for p in paths):
        assert time.monotonic() < deadline, f"{paths} not written"
        time.sleep(0.05)


@pytest.mark.parametrize(("exit_code", "container_code"), [(3, 3), (0, 1)])
def test_a_rank_that_exits_takes_its_tp_group_down(
    tmp_path: Path, exit_code: int, container_code: int
) -> None:
    """The container fails (so the kubelet restarts it) and the group's other ranks stop."""
    healthy, failing = tmp_path / "healthy.pid", tmp_path / "failing.pid"
    args = [
        *rank(healthy, "exec sleep 60"),
        ";",
        *rank(failing, f"while [ ! -s {healthy} ]; do sleep 0.05; done; exit {exit_code}"),
    ]
    result = subprocess.run(
        [*supervisor_command(), *args], capture_output=True, text=True, timeout=30, check=False
    )
    assert result.returncode == container_code, result.stderr
    assert "stopping the TP group" in result.stderr
    assert not is_running(healthy)


def test_sigterm_stops_every_rank_and_the_container_exits_cleanly(tmp_path: Path) -> None:
    pid_files = [tmp_path / f"rank{i}.pid" for i in range(3)]
    args: list[str] = []
    for pid_file in pid_files:
        args += [*([";"] if args else []), *rank(pid_file, "exec sleep 60")]
    supervisor = subprocess.Popen([*supervisor_command(), *args], stderr=subprocess.PIPE)
    try:
        wait_for(pid_files)
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(timeout=30) == 0
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()
    assert not any(is_running(p) for p in pid_files)

"""The chart's wiring, proven by running it: render the CPU ci values, start every rendered pod's
command, args and environment as a local process (cluster DNS names and ports mapped to loopback,
volumes to folders; see local_cluster.py), wait for the pods' own gRPC probes, and stream an
answer through the frontend Service."""

from __future__ import annotations

import json
import re
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc
from tests.helm.chart_render import (
    CHART_DIR,
    CI_DIR,
    CLUSTER_DOMAIN,
    Manifests,
    deep_merge,
    flag_value,
    load_values,
    only_container,
    render,
)
from tests.helm.local_cluster import LocalCluster, WiringError, metric_names

BIN_DIR = Path(sys.executable).parent
READY_TIMEOUT_S = 420.0
MAX_TOKENS = 12
CASES = [
    pytest.param("cpu-values.yaml", id="tp2-embedded-model"),
    pytest.param("cpu-pp2-hostpath-values.yaml", id="pp2-hostpath-model"),
]


@dataclass
class Launched:
    values: dict[str, Any]
    manifests: Manifests
    cluster: LocalCluster
    frontend: str  # loopback address behind the frontend Service


def case_values(name: str, model_dir: Path) -> dict[str, Any]:
    values = load_values(CI_DIR / name)
    if values.get("model", {}).get("source") == "hostPath":
        # The node folder holds the tiny model the test session built.
        values = deep_merge(
            values,
            {"model": {"hostPath": {"path": str(model_dir.parent)}, "subPath": model_dir.name}},
        )
    return values


def frontend_address(cluster: LocalCluster, manifests: Manifests) -> str:
    svc = manifests.get("Service", f"{manifests.release}-frontend")
    host = f"{svc['metadata']['name']}.{manifests.namespace}.svc.{CLUSTER_DOMAIN}"
    return cluster.address(host, int(svc["spec"]["ports"][0]["port"]))


def test_wiring_resolves_without_starting_anything(tmp_path: Path) -> None:
    """Every address and path in the CPU pods maps onto a pod port or a volume."""
    manifests = render(load_values(CI_DIR / "cpu-values.yaml"))
    cluster = LocalCluster(manifests, tmp_path, BIN_DIR)
    core = cluster.pods_of("core")[0]
    workers = cluster.pods_of("worker")
    assert [w.name for w in workers] == ["splitserve-worker-0", "splitserve-worker-1"]
    addrs = flag_value(core.argv, "--worker-addrs")
    assert addrs == ",".join(f"127.0.0.1:{w.loopback_port('grpc')}" for w in workers)
    init = flag_value(core.argv, "--distributed-init-method")
    assert init == f"tcp://127.0.0.1:{workers[0].loopback_port('dist')}"
    frontend = cluster.pods_of("frontend")[0]
    assert flag_value(frontend.argv, "--core-addr") == f"127.0.0.1:{core.loopback_port('grpc')}"
    for pod in cluster.pods:
        assert pod.env["SPLITSERVE_CACHE_DIR"].startswith(str(pod.root))
        assert pod.env["HOME"].startswith(str(pod.root))
        assert flag_value(pod.argv, "--host") == "127.0.0.1"


def test_emulator_rejects_broken_wiring(tmp_path: Path) -> None:
    manifests = render(load_values(CI_DIR / "cpu-values.yaml"))
    args = only_container(manifests.workload("core"))["args"]
    index = args.index("--worker-addrs") + 1
    args[index] = args[index].replace("worker-headless", "workers")
    with pytest.raises(WiringError, match="does not resolve"):
        LocalCluster(manifests, tmp_path / "a", BIN_DIR)
    # HOME of the image is on the read-only root filesystem: pointing a cache there breaks.
    manifests = render({"extraEnv": [{"name": "XDG_CACHE_HOME", "value": "/home/splitserve"}]})
    with pytest.raises(WiringError, match="read-only"):
        LocalCluster(manifests, tmp_path / "b", BIN_DIR)


@pytest.fixture(scope="module", params=CASES)
def launched(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model_dir: Path,
) -> Iterator[Launched]:
    values = case_values(request.param, tiny_model_dir)
    manifests = render(values)
    cluster = LocalCluster(manifests, tmp_path_factory.mktemp("cluster"), BIN_DIR)
    try:
        cluster.start()
        cluster.wait_ready(READY_TIMEOUT_S)
        yield Launched(values, manifests, cluster, frontend_address(cluster, manifests))
    finally:
        cluster.stop()


def generate(address: str, prompt: str, max_tokens: int) -> list[gen_pb2.GenerateResponse]:
    params = types_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with grpc.insecure_channel(address) as channel:
        stub = gen_grpc.GenerationServiceStub(channel)
        return list(
            stub.Generate(
                gen_pb2.GenerateRequest(prompt=prompt, sampling_params=params), timeout=180
            )
        )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_frontend_streams_an_answer(launched: Launched) -> None:
    responses = generate(launched.frontend, "The quick brown fox", MAX_TOKENS)
    tokens = [t for r in responses for t in r.token_ids]
    assert len(responses) >= 2, "the answer did not stream"
    assert len(tokens) == MAX_TOKENS
    assert responses[-1].finish_reason == types_pb2.FINISH_REASON_LENGTH
    assert all(r.finish_reason == types_pb2.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
    assert "".join(r.text for r in responses)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_engine_runs_the_layout_and_settings_of_the_values(launched: Launched) -> None:
    with grpc.insecure_channel(launched.frontend) as channel:
        info = gen_grpc.GenerationServiceStub(channel).GetModelInfo(
            gen_pb2.GetModelInfoRequest(), timeout=30
        )
    par = launched.values["parallelism"]
    assert info.tensor_parallel_size == par["tensorParallelSize"]
    assert info.pipeline_parallel_size == par["pipelineParallelSize"]
    assert info.max_model_len == launched.values["core"]["maxModelLen"]
    assert info.max_num_seqs == launched.values["core"]["maxNumSeqs"]
    model = launched.values["model"]
    expected_name = model.get("servedModelName") or "tiny-llama-v1"
    assert info.served_model_name == expected_name
    if model["source"] == "hostPath":
        # The core was told the in-pod path; the workers loaded it from their mount.
        assert info.model_path.endswith(f"/{model['subPath']}")
    assert len(launched.cluster.pods_of("worker")) == (
        par["tensorParallelSize"] * par["pipelineParallelSize"]
    )


def scrape(launched: Launched) -> dict[str, set[str]]:
    names = {}
    for pod in launched.cluster.pods:
        url = f"http://127.0.0.1:{pod.loopback_port('metrics')}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            assert reply.status == 200
            names[pod.name] = metric_names(reply.read().decode())
    return names


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_pod_serves_prometheus_metrics_on_its_metrics_port(launched: Launched) -> None:
    for pod, names in scrape(launched).items():
        assert names, f"{pod} exports no metrics"


def dashboard_exprs(node: Any) -> list[str]:
    """Every PromQL `expr` in a Grafana dashboard (panels, rows, targets, at any depth)."""
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [e for value in node.values() for e in dashboard_exprs(value)]
    if isinstance(node, list):
        return [e for item in node for e in dashboard_exprs(item)]
    return []


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_alerts_and_dashboard_use_metrics_the_pods_export(launched: Launched) -> None:
    generate(launched.frontend, "Metrics after a request", 4)
    exported = set().union(*scrape(launched).values())
    rule = render(deep_merge(launched.values, {"metrics": {"prometheusRule": {"enabled": True}}}))
    exprs = [r["expr"] for r in rule.of_kind("PrometheusRule")[0]["spec"]["groups"][0]["rules"]]
    for dashboard in (CHART_DIR / "dashboards").glob("*.json"):
        exprs += dashboard_exprs(json.loads(dashboard.read_text()))
    used = set(re.findall(r"vllm:[a-z0-9_]+", " ".join(exprs)))
    missing = sorted(u for u in used if u not in exported)
    assert not missing, f"alerts / dashboards use metrics no pod exports: {missing}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pods_stop_cleanly_on_sigterm(launched: Launched) -> None:
    launched.cluster.stop()
    codes = {p.name: p.process.returncode for p in launched.cluster.pods if p.process}
    logs = "\n".join(
        f"--- {p.name} (exit {codes[p.name]}) ---\n{p.log_tail(25)}"
        for p in launched.cluster.pods
        if codes.get(p.name) != 0
    )
    assert all(code == 0 for code in codes.values()), f"{codes}\n{logs}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_engine_recovers_when_the_core_pod_restarts(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Kubernetes restarts a failed core container (liveness, crash, eviction) while the worker
    pods keep running; the new core must bring the same ranks up again and serve."""
    manifests = render(case_values("cpu-pp2-hostpath-values.yaml", tiny_model_dir))
    cluster = LocalCluster(manifests, tmp_path, BIN_DIR)
    try:
        cluster.start()
        cluster.wait_ready(READY_TIMEOUT_S)
        frontend = frontend_address(cluster, manifests)
        assert generate(frontend, "before", 4)
        cluster.restart(cluster.pods_of("core")[0])
        cluster.wait_ready(READY_TIMEOUT_S)
        tokens = [t for r in generate(frontend, "after the restart", 4) for t in r.token_ids]
        assert len(tokens) == 4
    finally:
        cluster.stop()

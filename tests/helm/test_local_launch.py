"""The chart's wiring, proven by running it: render the CPU ci values, start every rendered pod's
command, args and environment as a local process (cluster DNS names and ports mapped to loopback,
volumes to folders; see local_cluster.py), wait for the pods' own gRPC probes, and stream an
answer through the frontend Service. Layouts: perRank (TP=2; PP=2), tpGroup (TP=2 x PP=2, the
bash supervisor and its rank processes), and tpGroup as a LeaderWorkerSet whose model comes from
the Hub (a local stand-in for it, fake_hub.py) through the download init containers."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.core.v1 import core_service_pb2 as core_pb2
from splitserve_contracts.core.v1 import core_service_pb2_grpc as core_grpc
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc
from tests.helm.chart_render import (
    CHART_DIR,
    CI_DIR,
    CLUSTER_DOMAIN,
    Manifests,
    container_processes,
    deep_merge,
    flag_value,
    load_values,
    only_container,
    render,
)
from tests.helm.fake_hub import hub_calls, install_fake_hub
from tests.helm.local_cluster import LocalCluster, LocalPod, WiringError, metric_names
from tests.metrics.dashboard_queries import is_pending

BIN_DIR = Path(sys.executable).parent
READY_TIMEOUT_S = 420.0
MAX_TOKENS = 12
HUB_REPO = "splitserve/default-llama-v1"
HUB_TOKEN = "hf_not_a_real_token"
# On top of the tpGroup values: the worker pods as one LeaderWorkerSet group, the model from the
# Hub into a created claim, the token from a user-made Secret.
LWS_HUB = {
    "model": {
        "source": "hub",
        "hub": {"repoId": HUB_REPO, "tokenSecret": {"name": "hf-token", "key": "token"}},
        "pvc": {"create": True},
    },
    "worker": {"leaderWorkerSet": {"enabled": True}},
}
# (The tpGroup values as a StatefulSet are launched by the TP-group restart test below.)
CASES = [
    pytest.param(("cpu-values.yaml", {}), id="tp2-embedded-model"),
    pytest.param(("cpu-pp2-hostpath-values.yaml", {}), id="pp2-hostpath-model"),
    pytest.param(("cpu-tpgroup-values.yaml", LWS_HUB), id="tpgroup-lws-hub"),
]


@dataclass
class Launched:
    values: dict[str, Any]
    manifests: Manifests
    cluster: LocalCluster
    frontend: str  # loopback address behind the frontend Service
    hub_env: dict[str, str]  # the fake Hub's environment ({} = no Hub)


def case_values(name: str, model_dir: Path, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    values = deep_merge(load_values(CI_DIR / name), extra or {})
    if values.get("model", {}).get("source") == "hostPath":
        # The node folder holds the tiny model the test session built.
        values = deep_merge(
            values,
            {"model": {"hostPath": {"path": str(model_dir.parent)}, "subPath": model_dir.name}},
        )
    return values


def service_address(cluster: LocalCluster, manifests: Manifests, component: str) -> str:
    svc = manifests.get("Service", f"{manifests.release}-{component}")
    host = f"{svc['metadata']['name']}.{manifests.namespace}.svc.{CLUSTER_DOMAIN}"
    return cluster.address(host, int(svc["spec"]["ports"][0]["port"]))


def frontend_address(cluster: LocalCluster, manifests: Manifests) -> str:
    return service_address(cluster, manifests, "frontend")


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
    # The core forwards its --model to the workers: a worker without the model volume breaks.
    values = {"model": {"source": "pvc", "pvc": {"existingClaim": "models"}}}
    manifests = render(values)
    worker = only_container(manifests.workload("worker"))
    worker["volumeMounts"] = [m for m in worker["volumeMounts"] if m["name"] != "model"]
    with pytest.raises(WiringError, match="--model of splitserve-core-0 uses /models"):
        LocalCluster(manifests, tmp_path / "c", BIN_DIR)


@pytest.fixture(scope="module", params=CASES)
def launched(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model_dir: Path,
) -> Iterator[Launched]:
    values_file, extra = request.param
    values = case_values(values_file, tiny_model_dir, extra)
    manifests = render(values)
    hub_env: dict[str, str] = {}
    if values["model"]["source"] == "hub":
        hub_env = install_fake_hub(
            tmp_path_factory.mktemp("hub"), {values["model"]["hub"]["repoId"]: tiny_model_dir}
        )
    cluster = LocalCluster(
        manifests,
        tmp_path_factory.mktemp("cluster"),
        BIN_DIR,
        secrets={"hf-token": {"token": HUB_TOKEN}},
        init_env=hub_env,
    )
    try:
        cluster.start()
        cluster.wait_ready(READY_TIMEOUT_S)
        address = frontend_address(cluster, manifests)
        yield Launched(values, manifests, cluster, address, hub_env)
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
    hub_name = model["hub"]["repoId"] if model["source"] == "hub" else None
    expected_name = model.get("servedModelName") or hub_name or "tiny-llama-v1"
    assert info.served_model_name == expected_name
    assert info.model_path == ""  # clients never see server paths (docs/reliability.md)
    if model["source"] == "hostPath":
        # The core was told the in-pod path; the workers loaded it from their mount.
        core = service_address(launched.cluster, launched.manifests, "core")
        with grpc.insecure_channel(core) as channel:
            hello = core_grpc.EngineCoreServiceStub(channel).Handshake(
                core_pb2.HandshakeRequest(), timeout=30
            )
        assert hello.engine_info.model_path.endswith(f"/{model['subPath']}")
    ranks = [
        r for p in launched.cluster.pods_of("worker") for r in container_processes(p.container)
    ]
    assert len(ranks) == par["tensorParallelSize"] * par["pipelineParallelSize"]


def scrape(launched: Launched) -> dict[str, set[str]]:
    """Metric names by process: every port named metrics or metrics-<local rank> of every pod."""
    names = {}
    for pod in launched.cluster.pods:
        for port_name in pod.port_names:
            if port_name != "metrics" and not port_name.startswith("metrics-"):
                continue
            url = f"http://127.0.0.1:{pod.loopback_port(port_name)}/metrics"
            with urllib.request.urlopen(url, timeout=10) as reply:
                assert reply.status == 200
                names[f"{pod.name}/{port_name}"] = metric_names(reply.read().decode())
    return names


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_pod_serves_prometheus_metrics_on_its_metrics_port(launched: Launched) -> None:
    scraped = scrape(launched)
    processes = [container_processes(p.container) for p in launched.cluster.pods]
    assert len(scraped) == sum(len(p) for p in processes)  # every rank of a tpGroup pod too
    for target, names in scraped.items():
        assert names, f"{target} exports no metrics"


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
    used = set(re.findall(r"\b(?:vllm:|splitserve_)[a-z0-9_]+", " ".join(exprs)))
    missing = sorted(u for u in used if u not in exported and not is_pending(u))
    assert not missing, f"alerts / dashboards use metrics no pod exports: {missing}"
    # (http_requests_total: only with frontend.httpPort; tests/metrics covers it.)


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


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hub_downloads_fill_what_each_pod_reads(launched: Launched) -> None:
    """Every worker pod downloaded the checkpoint into the claim at the path the core sends;
    every frontend only the tokenizer files, into its own cache; all with the Secret's token."""
    if not launched.hub_env:
        pytest.skip("this layout reads no model from the Hub")
    calls = hub_calls(launched.hub_env)
    cluster = launched.cluster
    workers, frontends = cluster.pods_of("worker"), cluster.pods_of("frontend")
    assert len(calls) == len(workers) + len(frontends)
    core_model = flag_value(cluster.pods_of("core")[0].argv, "--model")
    for call in calls:
        assert call["repo_id"] == HUB_REPO and call["HF_TOKEN"] == HUB_TOKEN
        assert call["HF_HUB_OFFLINE"] == "0"
    by_dir = {str(call["local_dir"]): call for call in calls}
    assert core_model in by_dir  # the folder the workers load from (the claim)
    assert any(str(f).endswith(".safetensors") for f in by_dir[core_model]["files"])
    for pod in frontends:
        tokenizer_dir = flag_value(pod.argv, "--model")
        assert tokenizer_dir is not None and tokenizer_dir.startswith(str(pod.root))
        files = by_dir[tokenizer_dir]["files"]
        assert "tokenizer.json" in files
        assert not any(str(f).endswith(".safetensors") for f in files)


def rank_pids(pod: LocalPod) -> list[int]:
    """PIDs of the `splitserve worker` processes a pod's container started (its TP ranks)."""
    assert pod.process is not None
    pids = []
    children = Path(f"/proc/{pod.process.pid}/task/{pod.process.pid}/children").read_text()
    for pid in map(int, children.split()):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"worker" in cmdline and any(arg.endswith(b"splitserve") for arg in cmdline):
            pids.append(pid)
    return pids


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} after {timeout:.0f} s"
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_tp_group_restarts_as_a_whole_and_the_engine_comes_back(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """tpGroup's recovery model, as the kubelet plays it: one TP rank dies; its pod's container
    fails as a whole (the supervisor stops the other rank) and is restarted; the engine core
    reports itself failed (liveness), is restarted, and brings every rank up again."""
    manifests = render(case_values("cpu-tpgroup-values.yaml", tiny_model_dir))
    cluster = LocalCluster(manifests, tmp_path, BIN_DIR)
    try:
        cluster.start()
        cluster.wait_ready(READY_TIMEOUT_S)
        frontend = frontend_address(cluster, manifests)
        assert generate(frontend, "before", 4)
        group = cluster.pods_of("worker")[1]  # the second pipeline stage
        assert group.process is not None
        ranks = rank_pids(group)
        assert len(ranks) == 2
        os.kill(ranks[1], signal.SIGKILL)  # a rank we started, by PID
        assert group.process.wait(timeout=60) != 0  # the container fails...
        assert not any(Path(f"/proc/{pid}").exists() for pid in ranks)  # ...with its whole group
        cluster.restart(group)  # the kubelet restarts the container
        core = cluster.pods_of("core")[0]
        wait_until(lambda: not cluster.probe(core, "livenessProbe"), 120, "core still live")
        cluster.restart(core)  # liveness failed: the kubelet restarts the core
        cluster.wait_ready(READY_TIMEOUT_S)
        tokens = [t for r in generate(frontend, "after the group restart", 4) for t in r.token_ids]
        assert len(tokens) == 4
    finally:
        cluster.stop()

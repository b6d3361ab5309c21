"""engines.replicas engines (docs/deploy.md, "Scale out: engines behind the gateway"): one
LeaderWorkerSet group per engine (leader pod: engine core + frontend; worker pods: the ranks in
worker.layout) and the smg gateway in front, discovering the engines by label (with the least
RBAC) or by their DNS names; HPA and KEDA scale engines. Rendered here, then launched: the CPU ci
values' two engines run as local processes (local_cluster.py) and a chat goes through the gateway
Service to both."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.helm.chart_render import (
    CI_DIR,
    CLUSTER_DOMAIN,
    NAMESPACE,
    Doc,
    Manifests,
    deep_merge,
    flag_value,
    labels_match,
    load_values,
    render,
)
from tests.helm.launched import launched, pod_counter
from tests.helm.local_cluster import LocalCluster
from tests.helm.security_values import user_secrets

ENGINES = load_values(CI_DIR / "cpu-engines-values.yaml")
AUTOSCALED = deep_merge(
    ENGINES,
    {
        "parallelism": {"tensorParallelSize": 2, "pipelineParallelSize": 2},
        "worker": {"gpu": {"enabled": True}},
        "engines": {"autoscaling": {"enabled": True, "maxReplicas": 6}},
        "gateway": {"discovery": "kubernetes", "policy": "round_robin"},
        "frontend": {"apiKey": {"secretName": "api-key", "key": "key"}},
    },
)


def leader(m: Manifests) -> Doc:
    lws = m.get("LeaderWorkerSet", f"{m.release}-engine")
    template: Doc = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    return template


def containers(m: Manifests) -> dict[str, Doc]:
    return {c["name"]: c for c in leader(m)["spec"]["containers"]}


def test_each_engine_is_a_group_with_its_own_core_frontend_and_ranks() -> None:
    m = render(ENGINES)
    assert not [w for w in m.workloads() if w["kind"] != "LeaderWorkerSet" and
                w["metadata"]["name"] != f"{m.release}-gateway"]  # fmt: skip
    lws = m.get("LeaderWorkerSet", f"{m.release}-engine")
    assert lws["spec"]["replicas"] == 2
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2  # the leader and one worker pod
    core, frontend = containers(m)["core"], containers(m)["frontend"]
    engine = f"{m.release}-engine"
    host = f"{engine}-$(ENGINE_INDEX)-1.{engine}.{NAMESPACE}.svc.{CLUSTER_DOMAIN}"
    assert flag_value(core["args"], "--worker-addrs") == f"{host}:50071"
    assert flag_value(core["args"], "--distributed-init-method") == f"tcp://{host}:29500"
    assert flag_value(core["args"], "--engine-id") == "$(ENGINE_INDEX)"
    assert flag_value(frontend["args"], "--core-addr") == "$(POD_IP):50061"
    assert "--data-parallel-rank" not in frontend["args"]  # its own pod: ZMQ ports unshifted
    assert "enable_kv_cache_events" in (flag_value(frontend["args"], "--kv-events-config") or "")
    index = {e["name"]: e for e in core["env"]}["ENGINE_INDEX"]
    label = "metadata.labels['leaderworkerset.sigs.k8s.io/group-index']"
    assert index["valueFrom"]["fieldRef"]["fieldPath"] == label
    ports = [p["name"] for c in containers(m).values() for p in c["ports"]]
    assert len(ports) == len(set(ports))  # a pod's port names are unique
    urls = flag_values_after(gateway_args(m), "--worker-urls")
    assert urls == [f"grpc://{engine}-{g}.{engine}.{NAMESPACE}.svc.{CLUSTER_DOMAIN}:50051"
                    for g in range(2)]  # fmt: skip


def gateway_args(m: Manifests) -> list[str]:
    gateway = m.get("Deployment", f"{m.release}-gateway")
    args: list[str] = gateway["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


def flag_values_after(args: list[str], flag: str) -> list[str]:
    rest = args[args.index(flag) + 1 :]
    return rest[: next((i for i, a in enumerate(rest) if a.startswith("--")), len(rest))]


def test_the_gateway_discovers_engine_leaders_by_label_with_least_rbac() -> None:
    m = render(AUTOSCALED)
    args = gateway_args(m)
    selector = dict(s.split("=", 1) for s in flag_values_after(args, "--selector"))
    lws = m.get("LeaderWorkerSet", f"{m.release}-engine")["spec"]["leaderWorkerTemplate"]
    assert labels_match(selector, lws["leaderTemplate"]["metadata"]["labels"])
    assert not labels_match(selector, lws["workerTemplate"]["metadata"]["labels"])
    assert flag_value(args, "--service-discovery-port") == "50051"
    assert flag_value(args, "--service-discovery-namespace") == NAMESPACE
    role = m.get("Role", f"{m.release}-gateway")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch"]}]  # fmt: skip
    binding = m.get("RoleBinding", f"{m.release}-gateway")
    assert binding["subjects"][0]["name"] == f"{m.release}-gateway"
    spec = m.get("Deployment", f"{m.release}-gateway")["spec"]["template"]["spec"]
    assert (spec["serviceAccountName"], spec["automountServiceAccountToken"]) == (
        f"{m.release}-gateway", True)  # fmt: skip
    # The API key: the gateway checks it; the engines behind it are not sent one.
    assert flag_value(args, "--api-key") == "$(GATEWAY_API_KEY)"
    assert "SPLITSERVE_API_KEY" not in {e["name"] for e in containers(m)["frontend"]["env"]}


def test_hpa_and_keda_scale_engines() -> None:
    m = render(AUTOSCALED)
    lws = m.get("LeaderWorkerSet", f"{m.release}-engine")
    assert "replicas" not in lws["spec"]  # the HPA owns it
    hpa = m.get("HorizontalPodAutoscaler", f"{m.release}-engine")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "leaderworkerset.x-k8s.io/v1",
                                             "kind": "LeaderWorkerSet",
                                             "name": f"{m.release}-engine"}  # fmt: skip
    assert hpa["spec"]["maxReplicas"] == 6
    keda = deep_merge(AUTOSCALED, {"engines": {"autoscaling": {"enabled": False},
                                               "keda": {"enabled": True}}})  # fmt: skip
    scaled = render(keda).get("ScaledObject", f"{m.release}-engine")
    assert scaled["spec"]["scaleTargetRef"]["kind"] == "LeaderWorkerSet"
    assert "vllm:num_requests_waiting" in scaled["spec"]["triggers"][0]["metadata"]["query"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"gateway": {"discovery": "static"}}, "gateway.discovery static"),
        ({"engines": {"keda": {"enabled": True}}}, "mutually exclusive"),
        ({"frontend": {"autoscaling": {"enabled": True}, "keda": {"enabled": False}},
          "engines": {"autoscaling": {"enabled": False}}}, "scale engines"),
    ],
)  # fmt: skip
def test_values_that_cannot_work_are_refused(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(Exception, match=message):
        render(deep_merge(AUTOSCALED, extra))


def test_engine_pods_are_the_inference_pools_model_servers() -> None:
    m = render(deep_merge(ENGINES, {"inferencePool": {"enabled": True}}))
    pool = m.get("InferencePool", m.release)
    assert labels_match(pool["spec"]["selector"]["matchLabels"], leader(m)["metadata"]["labels"])
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, cpu_kernels_dir: Path | None
) -> Iterator[tuple[Manifests, LocalCluster]]:
    manifests = render(ENGINES)
    folder = tmp_path_factory.mktemp("engines")
    with launched(manifests, folder, cpu_kernels_dir, user_secrets()) as local:
        yield manifests, local


def successes(cluster: LocalCluster) -> list[float]:
    """Requests each engine's frontend finished (its /metrics)."""
    return [
        pod_counter(pod, "vllm:request_success_total", "metrics")
        for pod in cluster.pods_of("frontend")
    ]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.extended
def test_two_engines_serve_chat_through_the_gateway(
    cluster: tuple[Manifests, LocalCluster],
) -> None:
    manifests, local = cluster
    host = f"{manifests.release}-gateway.{NAMESPACE}.svc.{CLUSTER_DOMAIN}"
    client = openai.OpenAI(
        base_url=f"http://{local.address(host, 8000)}/v1", api_key="-", max_retries=0, timeout=60
    )
    words = "river stone light window garden music paper water".split()
    for i in range(8):  # prompts of their own: cache_aware spreads them
        prompt = " ".join(words[(i + k) % len(words)] for k in range(6)) + f" {i}"
        reply = client.chat.completions.create(
            model="tiny-llama-v1", messages=[{"role": "user", "content": prompt}], max_tokens=4
        )
        assert reply.choices[0].finish_reason == "length"
    served = successes(local)
    assert len(served) == 2 and all(n > 0 for n in served), served
    cores = {flag_value(p.argv, "--engine-id") for p in local.pods_of("core")}
    assert cores == {"0", "1"}  # each core knows its engine from its group index

"""Model download and the hooks for routers and autoscalers: the Hub download init containers,
which pods mount the model, the pod label "model", the KEDA ScaledObject, the InferencePool and
the (future) OpenAI HTTP port."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm.chart_render import (
    CI_DIR,
    Doc,
    Manifests,
    component_of,
    container_env,
    container_port,
    flag_value,
    labels_match,
    only_container,
    pod_labels,
    pod_spec,
    render,
    render_values_file,
)
from tests.helm.network_policies import Peer, allowed, peers

HUB: dict[str, Any] = {
    "model": {
        "source": "hub",
        "hub": {"repoId": "meta-llama/Llama-3.1-8B-Instruct", "revision": "0e9e39f"},
        "pvc": {"existingClaim": "models"},
    }
}
LABEL_VALUE_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def init_container(workload: Doc, name: str = "model-download") -> Doc:
    found = [c for c in pod_spec(workload).get("initContainers", []) if c["name"] == name]
    assert len(found) == 1, f"{workload['metadata']['name']} has no init container {name}"
    container: Doc = found[0]
    return container


@pytest.fixture(scope="module")
def hub_manifests() -> Manifests:
    """HUB rendered once for the module (the tests only read it)."""
    return render(HUB)


def mount_of(container: Doc, volume: str) -> Doc | None:
    return next((m for m in container.get("volumeMounts", []) if m["name"] == volume), None)


# -- who mounts the model ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "extra", "mounted_by"),
    [
        ("embedded", {}, set()),
        ("pvc", {"pvc": {"existingClaim": "models"}}, {"frontend", "worker"}),
        ("hostPath", {}, {"frontend", "worker"}),
        ("hub", HUB["model"], {"worker"}),
    ],
)
def test_only_pods_that_read_the_model_mount_it(
    source: str, extra: dict[str, Any], mounted_by: set[str]
) -> None:
    """Workers read the weights, frontends the tokenizer files (for hub: their own download),
    the core nothing: it only forwards the path."""
    m = render({"model": {**extra, "source": source}})
    for workload, container in m.main_containers():
        mount = mount_of(container, "model")
        volumes = {v["name"] for v in pod_spec(workload)["volumes"]}
        if component_of(workload) in mounted_by:
            assert mount is not None and mount["readOnly"] is True, component_of(workload)
        else:
            assert mount is None and "model" not in volumes, component_of(workload)


# -- Hugging Face Hub download --------------------------------------------------------------------


def test_workers_download_the_checkpoint_to_the_path_the_core_sends(
    hub_manifests: Manifests,
) -> None:
    m = hub_manifests
    worker = m.workload("worker")
    download = init_container(worker)
    core_model = flag_value(only_container(m.workload("core"))["args"], "--model")
    assert core_model == "/models/meta-llama/Llama-3.1-8B-Instruct"
    repo, revision, target, max_workers, *patterns = download["args"]
    assert (repo, revision, target, max_workers) == (
        "meta-llama/Llama-3.1-8B-Instruct",
        "0e9e39f",
        core_model,
        "8",
    )
    assert "*.safetensors" in patterns and "*.bin" not in patterns
    # The init container writes the claim; the worker reads it.
    assert mount_of(download, "model") == {"name": "model", "mountPath": "/models"}
    assert mount_of(only_container(worker), "model") == {
        "name": "model",
        "mountPath": "/models",
        "readOnly": True,
    }
    volume = next(v for v in pod_spec(worker)["volumes"] if v["name"] == "model")
    assert volume["persistentVolumeClaim"] == {"claimName": "models", "readOnly": False}
    # Served as the repo id, like `vllm serve meta-llama/...`.
    config = m.configmap_data("splitserve-config")
    assert config["SPLITSERVE_SERVED_MODEL_NAME"] == "meta-llama/Llama-3.1-8B-Instruct"


def test_frontends_download_only_the_tokenizer_into_their_cache(
    hub_manifests: Manifests,
) -> None:
    m = hub_manifests
    frontend = m.workload("frontend")
    download = init_container(frontend)
    tokenizer_dir = flag_value(only_container(frontend)["args"], "--model")
    _, _, target, _, *patterns = download["args"]
    assert target == tokenizer_dir
    assert not any("safetensors" in p for p in patterns)
    cache_mount = mount_of(download, "cache")
    assert cache_mount is not None and tokenizer_dir is not None
    cache = next(v for v in pod_spec(frontend)["volumes"] if v["name"] == cache_mount["name"])
    assert "emptyDir" in cache
    assert tokenizer_dir.startswith(cache_mount["mountPath"] + "/")


def test_downloads_get_the_token_and_go_online_while_the_services_stay_offline(
    hub_manifests: Manifests,
) -> None:
    values = {
        "model": {
            **HUB["model"],
            "hub": {**HUB["model"]["hub"], "endpoint": "https://hf-mirror.example.com"},
        }
    }
    values["model"]["hub"]["tokenSecret"] = {"name": "hf-token", "key": "token"}
    m = render(values)
    for component in ("frontend", "worker"):
        workload = m.workload(component)
        download = init_container(workload)
        env = {e["name"]: e for e in download["env"]}
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
        assert env["HF_ENDPOINT"]["value"] == "https://hf-mirror.example.com"
        assert container_env(m, download)["HF_HUB_OFFLINE"] == "0"
        assert container_env(m, only_container(workload))["HF_HUB_OFFLINE"] == "1"
        assert "HF_TOKEN" not in container_env(m, only_container(workload))
    anonymous = init_container(hub_manifests.workload("worker"))
    assert "HF_TOKEN" not in {e["name"] for e in anonymous["env"]}


def test_download_snippet_is_python(hub_manifests: Manifests) -> None:
    download = init_container(hub_manifests.workload("worker"))
    assert download["command"][:2] == ["python", "-c"]
    compile(download["command"][2], "model-download", "exec")


def test_hub_egress_is_allowed_only_for_the_downloading_pods() -> None:
    m = render({**HUB, "networkPolicy": {"restrictEgress": True}})
    p = peers(m)
    hub = Peer(namespace=None)  # outside the cluster
    assert allowed(m, p["worker"], hub, 443)
    assert allowed(m, p["frontend"], hub, 443)
    assert not allowed(m, p["core"], hub, 443)
    assert not allowed(m, p["worker"], hub, 80)
    closed = render(
        {
            "model": {"source": "pvc", "pvc": {"existingClaim": "models"}},
            "networkPolicy": {"restrictEgress": True},
        }
    )
    assert not allowed(closed, peers(closed)["worker"], hub, 443)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"model": {"source": "hub", "hub": {"repoId": "a/b"}}}, "existingClaim|create"),
        ({"model": {"source": "hub", "pvc": {"create": True}}}, "repoId"),
    ],
)
def test_hub_needs_a_claim_and_a_repo(values: dict[str, Any], message: str) -> None:
    with pytest.raises(Exception, match=message):
        render(values)


def test_a_created_claim_holds_the_download() -> None:
    m = render({"model": {"source": "hub", "hub": {"repoId": "a/b"}, "pvc": {"create": True}}})
    claim = m.of_kind("PersistentVolumeClaim")[0]
    volume = next(v for v in pod_spec(m.workload("worker"))["volumes"] if v["name"] == "model")
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


# -- pod label "model" ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "label"),
    [
        ({}, "tiny-llama-v1"),
        ({"servedModelName": "llama-3.1-70b-instruct"}, "llama-3.1-70b-instruct"),
        (HUB["model"], "meta-llama-Llama-3.1-8B-Instruct"),
        ({"source": "hostPath", "subPath": "Qwen2.5-7B"}, "Qwen2.5-7B"),
        ({"servedModelName": "org/" + "x" * 70 + "/"}, "org-" + "x" * 59),
        ({"servedModelName": "_Weird name!*"}, "Weird-name"),
    ],
)
def test_every_pod_carries_the_served_model_as_a_label(model: dict[str, Any], label: str) -> None:
    m = render({"model": model})
    for workload in m.workloads():
        value = pod_labels(workload)["model"]
        assert value == label
        assert len(value) <= 63 and set(value) <= LABEL_VALUE_CHARS
        assert value[0].isalnum() and value[-1].isalnum()
        # Not a selector label: changing the model must not make the selectors immutable-invalid.
        assert "model" not in workload["spec"]["selector"].get("matchLabels", {})


def test_router_labels_go_to_the_frontend_pods_only() -> None:
    m = render({"frontend": {"routerLabels": {"llm-d.ai/inference-serving": "true", "tier": "a"}}})
    for workload in m.workloads():
        labels = pod_labels(workload)
        is_frontend = component_of(workload) == "frontend"
        assert (labels.get("llm-d.ai/inference-serving") == "true") == is_frontend
        assert (labels.get("tier") == "a") == is_frontend


# -- KEDA -------------------------------------------------------------------------------------------


def scaled_object(values: dict[str, Any]) -> tuple[Manifests, Doc]:
    m = render(values)
    found = m.of_kind("ScaledObject")
    assert len(found) == 1
    return m, found[0]


def test_keda_scales_the_frontends_on_the_waiting_queue() -> None:
    m, so = scaled_object(
        {
            "frontend": {
                "keda": {
                    "enabled": True,
                    "minReplicaCount": 1,
                    "maxReplicaCount": 10,
                    "prometheus": {"serverAddress": "http://prom.mon:9090", "threshold": 7.5},
                }
            }
        }
    )
    target = so["spec"]["scaleTargetRef"]
    assert m.get(target["kind"], target["name"]) is m.workload("frontend")
    assert "replicas" not in m.workload("frontend")["spec"]  # KEDA's HPA owns them
    assert not m.of_kind("HorizontalPodAutoscaler")
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (1, 10)
    trigger = so["spec"]["triggers"][0]
    assert trigger["type"] == "prometheus"
    meta = trigger["metadata"]
    assert meta["serverAddress"] == "http://prom.mon:9090"
    assert meta["threshold"] == "7.5"
    query = meta["query"]
    assert "vllm:num_requests_waiting" in query
    # This release's engine only; one source per engine series (the core), so a plain sum.
    assert 'namespace="llm"' in query and 'service="splitserve-metrics"' in query
    assert query.startswith("sum(vllm:num_requests_waiting{")


def test_keda_query_and_auth_can_be_replaced() -> None:
    _, so = scaled_object(
        {
            "frontend": {
                "keda": {
                    "enabled": True,
                    "behavior": {"scaleDown": {"stabilizationWindowSeconds": 600}},
                    "prometheus": {
                        "query": 'sum(vllm:num_requests_waiting{model_name="x"})',
                        "authenticationRef": "prom-auth",
                    },
                }
            }
        }
    )
    trigger = so["spec"]["triggers"][0]
    assert trigger["metadata"]["query"] == 'sum(vllm:num_requests_waiting{model_name="x"})'
    assert trigger["authenticationRef"] == {"name": "prom-auth"}
    behavior = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior == {"scaleDown": {"stabilizationWindowSeconds": 600}}


def test_keda_and_the_hpa_are_mutually_exclusive() -> None:
    with pytest.raises(Exception, match="mutually exclusive"):
        render({"frontend": {"autoscaling": {"enabled": True}, "keda": {"enabled": True}}})


def test_promtool_accepts_the_keda_query(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    _, so = scaled_object({"frontend": {"keda": {"enabled": True}}})
    rules = {
        "groups": [
            {
                "name": "keda",
                "rules": [
                    {
                        "record": "keda:waiting",
                        "expr": so["spec"]["triggers"][0]["metadata"]["query"],
                    }
                ],
            }
        ]
    }
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


# -- InferencePool and the HTTP port ----------------------------------------------------------------


def inference_pool(values: dict[str, Any]) -> tuple[Manifests, Doc]:
    m = render({**values, "inferencePool": {"enabled": True, **values.get("inferencePool", {})}})
    found = m.of_kind("InferencePool")
    assert len(found) == 1
    return m, found[0]


def test_inference_pool_targets_the_frontends_http_port_by_default() -> None:
    """As for vLLM model servers: the gateway and its endpoint picker speak OpenAI HTTP."""
    m, pool = inference_pool({"inferencePool": {"endpointPicker": {"name": "epp"}}})
    selector = pool["spec"]["selector"]["matchLabels"]
    selected = [w for w in m.workloads() if labels_match(selector, pod_labels(w))]
    assert selected == [m.workload("frontend")]
    frontend = only_container(m.workload("frontend"))
    assert pool["spec"]["targetPorts"] == [{"number": container_port(frontend, "http")}]
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["appProtocol"] == "http"
    assert pool["spec"]["endpointPickerRef"] == {
        "name": "epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    # Without the HTTP port, the pool targets gRPC (HTTP/2 cleartext).
    m, pool = inference_pool({"frontend": {"httpPort": 0}})
    frontend = only_container(m.workload("frontend"))
    assert pool["spec"]["targetPorts"] == [{"number": container_port(frontend, "grpc")}]
    assert pool["spec"]["appProtocol"] == "kubernetes.io/h2c"


def test_inference_pool_can_pool_every_release_of_a_model() -> None:
    model = {"servedModelName": "llama-3.1-8b"}
    match = {"model": "llama-3.1-8b", "app.kubernetes.io/component": "frontend"}
    m, pool = inference_pool({"model": model, "inferencePool": {"matchLabels": match}})
    assert "endpointPickerRef" not in pool["spec"]
    other = render({"model": model}, name="llama-b")  # a second engine of the same model
    pods = [w for r in (m, other) for w in r.workloads()]
    selected = [w for w in pods if labels_match(match, pod_labels(w))]
    assert len(selected) == 2
    assert all(component_of(w) == "frontend" for w in selected)


def test_http_port_is_on_by_default_and_off_when_zero(default_manifests: Manifests) -> None:
    frontend = only_container(default_manifests.workload("frontend"))
    assert flag_value(frontend["args"], "--http-port") == "8000"
    assert container_port(frontend, "http") == 8000
    service = default_manifests.get("Service", "splitserve-frontend")
    assert {
        "name": "http",
        "port": 8000,
        "targetPort": "http",
        "protocol": "TCP",
        "appProtocol": "http",
    } in service["spec"]["ports"]
    p = peers(default_manifests)
    assert allowed(default_manifests, p["client"], p["frontend"], 8000)
    # 0 turns it off: the service's own default (8000) must not come back.
    m = render({"frontend": {"httpPort": 0}})
    frontend = only_container(m.workload("frontend"))
    assert flag_value(frontend["args"], "--http-port") == "-1"
    assert "http" not in {p["name"] for p in frontend["ports"]}
    assert "http" not in {
        p["name"] for p in m.get("Service", "splitserve-frontend")["spec"]["ports"]
    }
    assert "httpGet" not in frontend["readinessProbe"]


def test_ci_values_render_the_hooks() -> None:
    m = render_values_file(CI_DIR / "gpu-lws-hub-values.yaml")
    kinds = {d["kind"] for d in m.docs}
    assert {"LeaderWorkerSet", "ScaledObject", "InferencePool", "ServiceMonitor"} <= kinds
    assert not {"StatefulSet", "HorizontalPodAutoscaler"} & kinds
    assert (
        init_container(m.workload("worker"))["args"][0] == "meta-llama/Llama-3.1-405B-Instruct-FP8"
    )

"""What the rendered chart must mean, beyond being valid Kubernetes: probes, security, rank layout
and DNS wiring, GPU resources, network directions, monitoring objects, and that the services'
own flag parsers accept every container's command line and environment."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from core_svc.config import build_parser as core_parser
from core_svc.config import parse_config as parse_core
from frontend_svc.config import build_parser as frontend_parser
from frontend_svc.config import parse_config as parse_frontend
from splitserve_runtime.flags import FlagParser, env_name
from splitserve_runtime.services import SERVICES
from tests.helm.chart_render import (
    CHART_DIR,
    CLUSTER_DOMAIN,
    Manifests,
    component_of,
    container_env,
    container_port,
    container_processes,
    flag_value,
    labels_match,
    only_container,
    pod_labels,
    pod_spec,
    render,
)
from tests.helm.network_policies import Peer, allowed, peers
from tests.helm.security_values import mount_secrets, translate
from worker_svc.config import build_parser as worker_parser
from worker_svc.config import parse_config as parse_worker

READINESS = {kind: spec.grpc_service for kind, spec in SERVICES.items()}
PARSERS: dict[str, Callable[[], FlagParser]] = {
    "frontend": frontend_parser,
    "core": core_parser,
    "worker": worker_parser,
}
# Environment the chart sets that is not a flag: paths of writable places and library switches.
NON_FLAG_ENV = {
    "HOME",
    "TMPDIR",
    "SPLITSERVE_CACHE_DIR",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "PYTHONUNBUFFERED",
    "PYTHONDONTWRITEBYTECODE",
}
REQUIRED_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/version",
    "app.kubernetes.io/part-of",
    "helm.sh/chart",
)


# -- labels, selectors ------------------------------------------------------------------------


def test_every_object_carries_the_standard_labels(gpu_manifests: Manifests) -> None:
    for doc in gpu_manifests.docs:
        labels = doc["metadata"].get("labels", {})
        missing = [k for k in REQUIRED_LABELS if k not in labels]
        assert not missing, f"{doc['kind']}/{doc['metadata']['name']} lacks {missing}"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"


def test_every_selector_selects_pods_of_the_release(gpu_manifests: Manifests) -> None:
    pods = [pod_labels(w) for w in gpu_manifests.workloads()]
    for svc in gpu_manifests.of_kind("Service"):
        assert any(labels_match(svc["spec"]["selector"], p) for p in pods), svc["metadata"]
    for pdb in gpu_manifests.of_kind("PodDisruptionBudget"):
        assert any(labels_match(pdb["spec"]["selector"]["matchLabels"], p) for p in pods)
    for workload in gpu_manifests.workloads():
        assert labels_match(workload["spec"]["selector"]["matchLabels"], pod_labels(workload))
    hpa = gpu_manifests.of_kind("HorizontalPodAutoscaler")[0]
    target = hpa["spec"]["scaleTargetRef"]
    assert gpu_manifests.get(target["kind"], target["name"]) is gpu_manifests.workload("frontend")


@pytest.mark.parametrize("fixture", ["default_manifests", "gpu_manifests"])
def test_service_target_ports_exist_on_the_selected_pods(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    """Every Service port reaches a port of some pod it selects (the metrics Service's
    "metrics-i" ports only exist on the worker pods that hold several ranks)."""
    manifests: Manifests = request.getfixturevalue(fixture)
    for svc in manifests.of_kind("Service"):
        selected = [
            only_container(w)
            for w in manifests.workloads()
            if labels_match(svc["spec"]["selector"], pod_labels(w))
        ]
        for port in svc["spec"]["ports"]:
            target = port["targetPort"]
            names = [
                p.get("name") if isinstance(target, str) else p["containerPort"]
                for c in selected
                for p in c["ports"]
            ]
            assert target in names, (
                f"{svc['metadata']['name']}: no selected pod has port {target!r}"
            )


# -- pods: security, probes, volumes ----------------------------------------------------------


@pytest.mark.parametrize("fixture", ["default_manifests", "gpu_manifests"])
def test_pods_are_locked_down(fixture: str, request: pytest.FixtureRequest) -> None:
    manifests: Manifests = request.getfixturevalue(fixture)
    for workload, container in manifests.containers():
        spec = pod_spec(workload)
        pod_sc = spec["securityContext"]
        assert pod_sc["runAsNonRoot"] is True and pod_sc["runAsUser"] != 0
        assert pod_sc["seccompProfile"]["type"] == "RuntimeDefault"
        sc = container["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert not sc.get("capabilities", {}).get("add")
        assert sc.get("privileged", False) is False
        assert spec["automountServiceAccountToken"] is False
        # Service links would put e.g. SPLITSERVE_PORT=tcp://10.0.0.7:80 (from any Service named
        # "splitserve" in the namespace) into the environment, which the services parse as --port.
        assert spec["enableServiceLinks"] is False
        assert (
            spec["serviceAccountName"] == manifests.of_kind("ServiceAccount")[0]["metadata"]["name"]
        )


@pytest.mark.parametrize("fixture", ["default_manifests", "gpu_manifests", "tls_off_manifests"])
def test_probes_reach_a_port_the_kubelet_can_speak_to(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    """No exec probes. Core and workers: native gRPC probes, on the plaintext health-only port
    when their gRPC port demands a client certificate (mutual TLS), else on it. Frontend: ready
    when GET /health on the HTTP port answers, live while gRPC health "" does."""
    manifests: Manifests = request.getfixturevalue(fixture)
    is_tls = any(s["type"] == "kubernetes.io/tls" for s in manifests.of_kind("Secret"))
    for workload, container in manifests.main_containers():
        component = component_of(workload)
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert set(container[kind]) & {"exec", "tcpSocket"} == set(), f"{component} {kind}"
        liveness = container["livenessProbe"]["grpc"]
        assert liveness.get("service", "") == ""
        if component == "frontend":
            for kind in ("startupProbe", "readinessProbe"):
                probe = container[kind]["httpGet"]
                assert (probe["path"], probe["port"], probe["scheme"]) == (
                    "/health",
                    "http",
                    "HTTP",
                )
            assert liveness["port"] == container_port(container, "grpc")
            continue
        args = container_processes(container)[0].argv  # local rank 0 in a tpGroup pod
        port_name = "health" if is_tls else "grpc"
        assert liveness["port"] == container_port(container, port_name)
        readiness = container["readinessProbe"]["grpc"]
        assert readiness == {"port": liveness["port"], "service": READINESS[component]}
        if is_tls:
            assert flag_value(args, "--health-port") == str(liveness["port"])
        else:
            assert "--health-port" not in args
            assert "health" not in {p["name"] for p in container["ports"]}


def test_startup_probes_leave_time_for_loading_the_model(default_manifests: Manifests) -> None:
    frontend = only_container(default_manifests.workload("frontend"))["startupProbe"]
    # GET /health is 200 only once the engine core serves, i.e. every rank has loaded the model.
    assert frontend["httpGet"]["path"] == "/health"
    core = only_container(default_manifests.workload("core"))["startupProbe"]
    assert core["grpc"]["service"] == READINESS["core"]
    for probe in (frontend, core):
        assert probe["periodSeconds"] * probe["failureThreshold"] >= 20 * 60
    worker = only_container(default_manifests.workload("worker"))
    assert worker["startupProbe"]["grpc"].get("service", "") == ""
    liveness = worker["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 60


def test_writable_paths_are_emptydirs_and_the_rest_is_read_only(
    default_manifests: Manifests,
) -> None:
    for workload, container in default_manifests.containers():
        volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        env = container_env(default_manifests, container)
        assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
        for var in ("HOME", "SPLITSERVE_CACHE_DIR", "HF_HOME", "TMPDIR"):
            path = env[var]
            mount = max(
                (m for m in mounts if path == m or path.startswith(m.rstrip("/") + "/")),
                key=len,
                default=None,
            )
            assert mount is not None, f"{var}={path} is on the read-only root filesystem"
            assert "emptyDir" in volumes[mounts[mount]["name"]], f"{var}={path}"
            assert not mounts[mount].get("readOnly", False)


def test_workers_get_a_memory_backed_dev_shm(gpu_manifests: Manifests) -> None:
    worker = gpu_manifests.workload("worker")
    volumes = {v["name"]: v for v in pod_spec(worker)["volumes"]}
    mount = next(m for m in only_container(worker)["volumeMounts"] if m["mountPath"] == "/dev/shm")
    assert volumes[mount["name"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}


# -- rank layout and wiring -------------------------------------------------------------------


def test_frontend_dials_the_core_service(default_manifests: Manifests) -> None:
    m = default_manifests
    core_svc = m.get("Service", "splitserve-core")
    core_addr = flag_value(only_container(m.workload("frontend"))["args"], "--core-addr")
    port = core_svc["spec"]["ports"][0]
    assert core_addr == f"splitserve-core.{m.namespace}.svc.{CLUSTER_DOMAIN}:{port['port']}"
    assert labels_match(core_svc["spec"]["selector"], pod_labels(m.workload("core")))
    assert port["targetPort"] == "grpc"


def test_exactly_one_engine_core_that_never_overlaps_itself(gpu_manifests: Manifests) -> None:
    core = gpu_manifests.workload("core")
    assert core["kind"] == "Deployment"
    assert core["spec"]["replicas"] == 1
    assert core["spec"]["strategy"]["type"] == "Recreate"


def test_frontend_replicas_or_hpa(default_manifests: Manifests, gpu_manifests: Manifests) -> None:
    assert default_manifests.workload("frontend")["spec"]["replicas"] == 2
    assert not default_manifests.of_kind("HorizontalPodAutoscaler")
    # With the HPA on, the Deployment leaves replicas to it.
    assert "replicas" not in gpu_manifests.workload("frontend")["spec"]
    hpa = gpu_manifests.of_kind("HorizontalPodAutoscaler")[0]["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (3, 12)


@pytest.mark.parametrize(
    "fixture", ["default_manifests", "cpu_manifests", "gpu_manifests", "given_manifests"]
)
def test_service_flag_parsers_accept_every_container(
    fixture: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Run the services' real flag parsers on each container's args and environment, with the
    files of its Secret volumes where its flags point (the parsers read the certificates)."""
    m: Manifests = request.getfixturevalue(fixture)
    given = request.getfixturevalue("user_secret_data")
    parsers: dict[str, Callable[..., Any]] = {
        "frontend": parse_frontend,
        "core": parse_core,
        "worker": parse_worker,
    }
    num_ranks = 0
    for workload, container in m.main_containers():
        ports = {p["containerPort"] for p in container["ports"]}
        root = tmp_path / workload["metadata"]["name"]
        folders = mount_secrets(m, workload, container, root, given)
        for process in container_processes(container):
            argv = translate(process.argv, folders)
            assert argv[0] == "splitserve" and argv[1] == component_of(workload), argv
            env = {**container_env(m, container), **process.env}
            config = parsers[argv[1]](argv[2:], environ=env)
            assert config.port in ports and config.metrics_port in ports
            assert config.health_port is None or config.health_port in ports
            num_ranks += argv[1] == "worker"
    core_container = only_container(m.workload("core"))
    core_folders = mount_secrets(m, m.workload("core"), core_container, tmp_path / "c", given)
    core_args = translate(core_container["args"], core_folders)
    core = parse_core(core_args, environ=container_env(m, core_container))
    worker_pods = m.workload("worker")["spec"]["replicas"]
    assert core.world_size == num_ranks * worker_pods


def test_configmap_holds_only_known_settings(gpu_manifests: Manifests) -> None:
    known = {
        env_name(a.dest) for make in PARSERS.values() for a in make()._actions if a.option_strings
    }
    data = gpu_manifests.configmap_data("splitserve-config")
    unknown = set(data) - known - NON_FLAG_ENV
    assert not unknown, f"ConfigMap keys no service reads: {sorted(unknown)}"
    assert data["SPLITSERVE_DEVICE"] == "cuda"
    assert data["SPLITSERVE_SERVED_MODEL_NAME"] == "llama-3.1-70b-instruct"
    for workload, container in gpu_manifests.containers():
        refs = [s["configMapRef"]["name"] for s in container["envFrom"]]
        assert refs == ["splitserve-config"], workload["metadata"]["name"]
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert len(annotations["checksum/config"]) == 64


def test_big_numbers_are_not_rendered_in_float_notation() -> None:
    m = render({"core": {"kvCacheMemoryBytes": 8589934592, "seed": 1234567890123}})
    data = m.configmap_data("splitserve-config")
    assert data["SPLITSERVE_KV_CACHE_MEMORY_BYTES"] == "8589934592"
    assert data["SPLITSERVE_SEED"] == "1234567890123"


# -- GPU --------------------------------------------------------------------------------------


def test_gpu_workers_get_a_gpu_per_rank_and_the_cuda_image(gpu_manifests: Manifests) -> None:
    sts = gpu_manifests.workload("worker")
    # The GPU layout (tpGroup): one pod per pipeline stage with its two TP ranks' GPUs.
    assert sts["spec"]["replicas"] == 2
    worker = only_container(sts)
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == 2
    assert worker["resources"]["limits"]["memory"] == "96Gi"
    assert worker["image"] == "registry.example.com/ml/splitserve:0.1.0-cuda"
    spec = pod_spec(sts)
    assert spec["runtimeClassName"] == "nvidia"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in (
        spec["tolerations"]
    )
    for component in ("frontend", "core"):
        container = only_container(gpu_manifests.workload(component))
        assert container["image"] == "registry.example.com/ml/splitserve:0.1.0-cpu"
        assert "nvidia.com/gpu" not in json.dumps(container["resources"])


def test_cpu_values_have_no_gpu(cpu_manifests: Manifests) -> None:
    for _, container in cpu_manifests.containers():
        assert "nvidia.com/gpu" not in json.dumps(container.get("resources", {}))
        assert container["image"].endswith(":0.1.0-cpu")
    assert cpu_manifests.configmap_data("splitserve-config")["SPLITSERVE_DEVICE"] == "cpu"


def test_gpu_default_image_tag_is_the_cuda_variant() -> None:
    m = render({"worker": {"gpu": {"enabled": True}}})
    assert (
        only_container(m.workload("worker"))["image"] == "ghcr.io/splitserve/splitserve:0.1.0-cuda"
    )
    assert only_container(m.workload("core"))["image"] == "ghcr.io/splitserve/splitserve:0.1.0-cpu"


# -- model volume -----------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["pvc", "hostPath"])
def test_every_pod_sees_the_model_at_the_path_the_core_sends(source: str) -> None:
    values: dict[str, Any] = {
        "model": {
            "source": source,
            "mountPath": "/models",
            "subPath": "llama",
            "pvc": {"existingClaim": "models"},
        }
    }
    m = render(values)
    for component in ("frontend", "worker"):  # tokenizer files, weights
        workload = m.workload(component)
        container = only_container(workload)
        mount = next(x for x in container["volumeMounts"] if x["mountPath"] == "/models")
        assert mount["readOnly"] is True
        volume = next(v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"])
        if source == "pvc":
            assert volume["persistentVolumeClaim"]["claimName"] == "models"
        else:
            assert volume["hostPath"]["path"] == "/var/lib/splitserve/models"
    # The core only forwards the path to the workers: it mounts no model volume.
    core = m.workload("core")
    assert "model" not in {v["name"] for v in pod_spec(core)["volumes"]}
    for component in ("frontend", "core"):
        args = only_container(m.workload(component))["args"]
        assert flag_value(args, "--model") == "/models/llama", component


def test_embedded_model_is_the_tiny_model(default_manifests: Manifests) -> None:
    for component in ("frontend", "core"):
        args = only_container(default_manifests.workload(component))["args"]
        assert flag_value(args, "--model") == "tiny", component


def test_created_model_claim_survives_uninstall() -> None:
    m = render({"model": {"source": "pvc", "pvc": {"create": True, "size": "500Gi"}}})
    pvc = m.of_kind("PersistentVolumeClaim")[0]
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert pvc["spec"]["resources"]["requests"]["storage"] == "500Gi"
    volume = next(v for v in pod_spec(m.workload("worker"))["volumes"] if v["name"] == "model")
    assert volume["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]


# -- network policy ---------------------------------------------------------------------------


def test_network_policy_directions_by_default(default_manifests: Manifests) -> None:
    m = default_manifests
    p = peers(m)
    fe, core, wk = p["frontend"].ports, p["core"].ports, p["worker"].ports
    assert allowed(m, p["client"], p["frontend"], fe["grpc"])
    assert not allowed(m, p["client"], p["core"], core["grpc"])
    assert not allowed(m, p["client"], p["worker"], wk["grpc"])
    assert not allowed(m, p["other-pod"], p["core"], core["grpc"])
    assert allowed(m, p["frontend"], p["core"], core["grpc"])
    assert not allowed(m, p["frontend"], p["core"], 12345)
    assert not allowed(m, p["frontend"], p["worker"], wk["grpc"])
    assert allowed(m, p["core"], p["worker"], wk["grpc"])
    assert not allowed(m, p["core"], p["worker"], wk["dist"])
    assert not allowed(m, p["worker"], p["core"], core["grpc"])
    for port in (wk["grpc"], wk["dist"], 40123):  # TCPStore, gloo/NCCL ports are dynamic
        assert allowed(m, p["worker"], p["worker"], port)
    for name in ("frontend", "core", "worker"):
        assert allowed(m, p["monitoring"], p[name], p[name].ports["metrics"])
        assert not allowed(m, p["monitoring"], p[name], p[name].ports["grpc"]) or name == "frontend"


def test_network_policy_with_restricted_clients_and_egress(gpu_manifests: Manifests) -> None:
    m = gpu_manifests
    p = peers(m)
    fe, core, wk = p["frontend"].ports, p["core"].ports, p["worker"].ports
    assert allowed(m, p["ingress"], p["frontend"], fe["grpc"])
    assert not allowed(m, p["client"], p["frontend"], fe["grpc"])
    assert not allowed(m, p["other-pod"], p["frontend"], fe["grpc"])
    assert allowed(m, p["frontend"], p["core"], core["grpc"])
    assert allowed(m, p["core"], p["worker"], wk["grpc"])
    assert allowed(m, p["worker"], p["worker"], 40123)
    # Egress is closed in the other directions too.
    assert not allowed(m, p["core"], p["frontend"], fe["grpc"])
    assert not allowed(m, p["worker"], p["frontend"], fe["grpc"])
    assert not allowed(m, p["frontend"], p["worker"], wk["grpc"])
    dns = Peer({"k8s-app": "kube-dns"}, "kube-system")
    for name in ("frontend", "core", "worker"):
        assert allowed(m, p[name], dns, 53)
        assert not allowed(m, p[name], p["client"], 443)
        assert allowed(m, p["monitoring"], p[name], p[name].ports["metrics"])


# -- monitoring -------------------------------------------------------------------------------


def test_service_monitor_scrapes_every_pod_metrics_port(gpu_manifests: Manifests) -> None:
    m = gpu_manifests
    monitor = m.of_kind("ServiceMonitor")[0]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    selected = [
        s
        for s in m.of_kind("Service")
        if labels_match(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
    ]
    assert [s["metadata"]["name"] for s in selected] == ["splitserve-metrics"]
    svc = selected[0]
    endpoint_port = monitor["spec"]["endpoints"][0]["port"]
    svc_port = next(p for p in svc["spec"]["ports"] if p["name"] == endpoint_port)
    scraped = {
        component_of(w)
        for w in m.workloads()
        if labels_match(svc["spec"]["selector"], pod_labels(w))
    }
    assert scraped == {"frontend", "core", "worker"}
    for workload in m.workloads():
        container_port(only_container(workload), svc_port["targetPort"])


def test_grafana_dashboards_configmap_packages_every_dashboard(gpu_manifests: Manifests) -> None:
    cm = gpu_manifests.get("ConfigMap", "splitserve-dashboards")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["annotations"]["grafana_folder"] == "LLM"
    files = sorted(p.name for p in (CHART_DIR / "dashboards").glob("*.json"))
    assert files and sorted(cm["data"]) == files
    for name, text in cm["data"].items():
        dashboard = json.loads(text)
        assert dashboard["title"] and isinstance(dashboard["panels"], list), name
        assert text == (CHART_DIR / "dashboards" / name).read_text()


def test_monitoring_objects_are_optional(default_manifests: Manifests) -> None:
    kinds = {d["kind"] for d in default_manifests.docs}
    assert not kinds & {"ServiceMonitor", "PrometheusRule", "Ingress"}
    # The only Secrets by default: the generated internal certificates.
    secrets = sorted(d["metadata"]["name"] for d in default_manifests.of_kind("Secret"))
    assert secrets == [f"splitserve-internal-tls-{r}" for r in ("core", "frontend", "worker")]
    m = render(
        {
            "grafanaDashboard": {"enabled": False},
            "metrics": {"enabled": False},
            "networkPolicy": {"enabled": False},
        }
    )
    names = {(d["kind"], d["metadata"]["name"]) for d in m.docs}
    assert ("ConfigMap", "splitserve-dashboards") not in names
    assert ("Service", "splitserve-metrics") not in names
    assert not m.of_kind("NetworkPolicy")


# -- disruption, ingress, TLS -----------------------------------------------------------------


def test_disruption_budgets(default_manifests: Manifests) -> None:
    budgets = {component_of(p): p["spec"] for p in default_manifests.of_kind("PodDisruptionBudget")}
    assert budgets["frontend"]["maxUnavailable"] == 1
    # Losing any rank or the core stops the engine: voluntary evictions are blocked by default.
    assert budgets["core"]["maxUnavailable"] == 0
    assert budgets["worker"]["maxUnavailable"] == 0


def test_ingress_with_tls_secret(gpu_manifests: Manifests) -> None:
    ingress = gpu_manifests.of_kind("Ingress")[0]
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/backend-protocol"] == (
        "GRPC"
    )
    assert ingress["spec"]["tls"] == [
        {"secretName": "splitserve-tls", "hosts": ["llm.example.com"]}
    ]
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": "splitserve-frontend", "port": {"name": "grpc"}}


def test_tls_secrets_are_created_from_values() -> None:
    cert, key = "-----BEGIN CERTIFICATE-----\nabc\n", "-----BEGIN PRIVATE KEY-----\ndef\n"
    m = render({"tlsSecrets": [{"name": "llm-tls", "certificate": cert, "key": key}]})
    secret = m.get("Secret", "llm-tls")
    assert secret["type"] == "kubernetes.io/tls"
    assert base64.b64decode(secret["data"]["tls.crt"]).decode() == cert
    assert base64.b64decode(secret["data"]["tls.key"]).decode() == key


def test_scheduling_knobs_reach_the_pods(gpu_manifests: Manifests) -> None:
    worker = pod_spec(gpu_manifests.workload("worker"))
    assert worker["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert "podAffinity" in worker["affinity"]
    frontend = pod_spec(gpu_manifests.workload("frontend"))
    assert frontend["topologySpreadConstraints"][0]["topologyKey"] == "topology.kubernetes.io/zone"
    assert frontend["imagePullSecrets"] == [{"name": "regcred"}]
    env = only_container(gpu_manifests.workload("worker"))["env"]
    assert {"name": "NCCL_DEBUG", "value": "WARN"} in env


def test_log_level_and_format_reach_every_process() -> None:
    """logLevel and logFormat (json for log collectors) apply to every process of every pod."""
    m = render({"logLevel": "debug", "logFormat": "json"})
    for _, container in m.main_containers():
        env = container_env(m, container)
        for process in container_processes(container):
            parser = PARSERS[process.argv[1]]()
            args = parser.parse(process.argv[2:], {**env, **process.env})
            assert (args.log_level, args.log_format) == ("debug", "json"), process.argv[1]


@pytest.mark.parametrize(
    ("gpu", "expected"),
    [
        ({"enabled": False}, (None, None)),  # CPU: the engine core's own (vLLM-CPU's) defaults
        ({"enabled": True}, ("256", "2048")),  # memory unknown: vLLM's smallest class
        ({"enabled": True, "memoryGiB": 80, "product": "NVIDIA-H100-80GB-HBM3"}, ("1024", "8192")),
        ({"enabled": True, "memoryGiB": 141, "product": "NVIDIA-H200"}, ("1024", "8192")),
        ({"enabled": True, "memoryGiB": 80, "product": "NVIDIA-A100-SXM4-80GB"}, ("256", "2048")),
        ({"enabled": True, "memoryGiB": 192, "product": "NVIDIA-B200"}, ("1024", "16384")),
    ],
)
def test_batch_defaults_follow_vllms_per_gpu_class(
    gpu: dict[str, Any], expected: tuple[str | None, str | None]
) -> None:
    """vLLM 0.32's EngineArgs.get_batch_defaults (`vllm serve`) when maxNumSeqs and
    maxNumBatchedTokens are 0 (the default); a value set by the operator wins."""
    data = render({"worker": {"gpu": gpu}}).configmap_data("splitserve-config")
    found = (data.get("SPLITSERVE_MAX_NUM_SEQS"), data.get("SPLITSERVE_MAX_NUM_BATCHED_TOKENS"))
    assert found == expected
    values = {"worker": {"gpu": gpu}, "core": {"maxNumSeqs": 8, "maxNumBatchedTokens": 512}}
    data = render(values).configmap_data("splitserve-config")
    assert (data["SPLITSERVE_MAX_NUM_SEQS"], data["SPLITSERVE_MAX_NUM_BATCHED_TOKENS"]) == (
        "8",
        "512",
    )

"""Every rendered manifest passes `kubernetes-validate --strict` for Kubernetes 1.30. The custom
resources it only warns about get schemas of their own: the Prometheus Operator objects a
hand-written one, LeaderWorkerSet, ScaledObject and InferencePool their upstream CRDs' schemas
(tests/helm/crd_schemas/), and the LeaderWorkerSet's pod template kubernetes-validate as a
PodTemplate."""

from __future__ import annotations

import copy
import functools
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml

from tests.helm.chart_render import (
    KUBE_VERSION,
    REPO_ROOT,
    Doc,
    Manifests,
    ci_values_files,
    load_values,
    render,
)
from tests.helm.security_values import GIVEN, TLS_OFF

# Everything optional switched on at once, so that every template is validated.
KITCHEN_SINK: dict[str, Any] = {
    "commonLabels": {"team": "llm"},
    "imagePullSecrets": [{"name": "regcred"}],
    "serviceAccount": {"annotations": {"iam.example.com/role": "splitserve"}},
    "extraEnv": [{"name": "EXTRA", "value": "1"}],
    "model": {"source": "pvc", "subPath": "m", "pvc": {"create": True, "storageClassName": "fast"}},
    "parallelism": {"tensorParallelSize": 4, "pipelineParallelSize": 2},
    "frontend": {
        "service": {"type": "LoadBalancer", "nodePort": 30051, "annotations": {"a": "b"}},
        "autoscaling": {
            "enabled": True,
            "targetMemoryUtilizationPercentage": 80,
            "behavior": {"scaleUp": {"stabilizationWindowSeconds": 0}},
        },
        "ingress": {
            "enabled": True,
            "className": "nginx",
            "hosts": ["llm.example.com"],
            "tls": [{"secretName": "llm-tls", "hosts": ["llm.example.com"]}],
        },
        "extraVolumes": [{"name": "extra", "emptyDir": {}}],
        "extraVolumeMounts": [{"name": "extra", "mountPath": "/extra"}],
        "priorityClassName": "high",
        "podAnnotations": {"x": "y"},
        "podLabels": {"tier": "api"},
        "extraArgs": ["--max-n", "8"],
        "httpPort": 8000,
    },
    "inferencePool": {"enabled": True, "endpointPicker": {"name": "epp"}},
    "core": {"extraEnv": [{"name": "CORE_EXTRA", "value": "1"}], "kvCacheMemoryBytes": 8589934592},
    "worker": {
        "gpu": {"enabled": True},
        "runtimeClassName": "nvidia",
        "extraArgs": ["--log-level", "debug"],
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    },
    "networkPolicy": {
        "restrictEgress": True,
        "extraEgress": [{"to": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]}],
    },
    "metrics": {
        "serviceMonitor": {
            "enabled": True,
            "labels": {"release": "prometheus"},
            "relabelings": [{"action": "labeldrop", "regex": "tmp"}],
        },
        "prometheusRule": {
            "enabled": True,
            "additionalRules": [{"alert": "Extra", "expr": "vector(1) > 2", "for": "1m"}],
        },
    },
    "grafanaDashboard": {"namespace": "monitoring", "annotations": {"grafana_folder": "LLM"}},
    "tlsSecrets": [
        {
            "name": "llm-tls",
            "certificate": "-----BEGIN CERTIFICATE-----\nx\n",
            "key": "-----BEGIN PRIVATE KEY-----\ny\n",
        }
    ],
}

# Engine groups with everything on: KEDA on the engines, the gateway discovering them (its RBAC),
# restricted egress, an API key, monitoring and an InferencePool, GPU TP=2 x PP=2 per engine.
ENGINE_GROUPS: dict[str, Any] = {
    "engines": {"keda": {"enabled": True, "maxReplicaCount": 8}},
    "gateway": {"policy": "round_robin", "extraArgs": ["--cache-threshold", "0.5"]},
    "parallelism": {"tensorParallelSize": 2, "pipelineParallelSize": 2},
    "worker": {"gpu": {"enabled": True}},
    "frontend": {"apiKey": {"secretName": "api-key", "key": "key"}},
    "networkPolicy": {"restrictEgress": True, "enginesFrom": [{"podSelector": {}}]},
    "metrics": {"serviceMonitor": {"enabled": True}},
    "inferencePool": {"enabled": True},
}

CASES = [
    pytest.param(None, id="defaults"),
    pytest.param(ENGINE_GROUPS, id="engine-groups"),
    pytest.param(KITCHEN_SINK, id="kitchen-sink"),
    pytest.param(TLS_OFF, id="internal-tls-off"),
    pytest.param(GIVEN, id="secrets-given-api-key-public-tls"),
] + [pytest.param(load_values(p), id=p.name) for p in ci_values_files()]

DURATION = {"type": "string", "pattern": r"^([0-9]+(ms|s|m|h|d|w|y))+$"}
LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
METADATA = {
    "type": "object",
    "required": ["name", "labels"],
    "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}, "labels": LABELS},
}
# The parts of the Prometheus Operator CRDs (monitoring.coreos.com/v1) the chart uses.
SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": METADATA,
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "required": ["matchLabels"],
                    "properties": {"matchLabels": LABELS},
                },
                "namespaceSelector": {
                    "type": "object",
                    "properties": {
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                        "any": {"type": "boolean"},
                    },
                    "additionalProperties": False,
                },
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "targetLabels": {"type": "array", "items": {"type": "string"}},
                "jobLabel": {"type": "string"},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["port"],
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": DURATION,
                            "scrapeTimeout": DURATION,
                            "relabelings": {"type": "array", "items": {"type": "object"}},
                            "metricRelabelings": {"type": "array", "items": {"type": "object"}},
                        },
                    },
                },
            },
        },
    },
}
RULE = {
    "type": "object",
    "additionalProperties": False,
    "oneOf": [{"required": ["alert", "expr"]}, {"required": ["record", "expr"]}],
    "properties": {
        "alert": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
        "record": {"type": "string"},
        "expr": {"type": "string", "minLength": 1},
        "for": DURATION,
        "labels": LABELS,
        "annotations": LABELS,
    },
}
PROMETHEUS_RULE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": METADATA,
        "spec": {
            "type": "object",
            "required": ["groups"],
            "additionalProperties": False,
            "properties": {
                "groups": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["name", "rules"],
                        "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string"},
                            "interval": DURATION,
                            "rules": {"type": "array", "items": RULE},
                        },
                    },
                }
            },
        },
    },
}
CRD_SCHEMA_DIR = REPO_ROOT / "tests" / "helm" / "crd_schemas"
CRD_SCHEMAS: dict[str, dict[str, Any]] = {
    "ServiceMonitor": SERVICE_MONITOR_SCHEMA,
    "PrometheusRule": PROMETHEUS_RULE_SCHEMA,
    **{
        kind: json.loads((CRD_SCHEMA_DIR / f"{kind.lower()}.json").read_text())
        for kind in ("LeaderWorkerSet", "ScaledObject", "InferencePool")
    },
}


@functools.cache
def read_schemas_once() -> None:
    """kubernetes-validate reads and parses its schema files again on every call (among them
    the 1.2 MB _definitions.json); they do not change while the tests run: parse each once."""
    import kubernetes_validate.utils  # type: ignore[import-untyped]

    utils = kubernetes_validate.utils
    utils.schema_contents = functools.cache(utils.schema_contents)


def validate_doc(doc: Doc) -> None:
    import kubernetes_validate

    read_schemas_once()
    if doc["kind"] not in CRD_SCHEMAS:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        return
    jsonschema.validate(doc, CRD_SCHEMAS[doc["kind"]])
    if doc["kind"] == "LeaderWorkerSet":
        group = doc["spec"]["leaderWorkerTemplate"]
        for key in ("leaderTemplate", "workerTemplate"):
            if key in group:
                template = {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": f"{doc['metadata']['name']}-{key}"},
                    "template": group[key],
                }
                kubernetes_validate.validate(template, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("values", CASES)
def test_every_manifest_passes_kubernetes_validate_strict(values: dict[str, Any] | None) -> None:
    failures = []
    for doc in render(values).docs:
        try:
            validate_doc(doc)
        except Exception as err:  # collect every failure, not just the first
            failures.append(f"{doc['kind']}/{doc['metadata']['name']}: {err}")
    assert not failures, "\n".join(failures)


def test_kitchen_sink_renders_every_optional_object() -> None:
    kinds = {d["kind"] for d in render(KITCHEN_SINK).docs}
    assert {
        "HorizontalPodAutoscaler",
        "InferencePool",
        "Ingress",
        "Secret",
        "PersistentVolumeClaim",
        "ServiceMonitor",
        "PrometheusRule",
    } <= kinds


CUSTOM_RESOURCES: dict[str, Any] = {
    "worker": {"layout": "tpGroup", "leaderWorkerSet": {"enabled": True}},
    "parallelism": {"tensorParallelSize": 2, "pipelineParallelSize": 2},
    "frontend": {"keda": {"enabled": True}},
    "inferencePool": {"enabled": True},
}


RULE_VALUES: dict[str, Any] = {"metrics": {"prometheusRule": {"enabled": True}}}


@pytest.fixture(scope="module")
def custom_resources() -> Manifests:
    """CUSTOM_RESOURCES rendered once for the module (each test corrupts its own copy)."""
    return render(CUSTOM_RESOURCES)


@pytest.fixture(scope="module")
def prometheus_rule() -> Doc:
    """The PrometheusRule of RULE_VALUES, rendered once for the module (read only)."""
    rule: Doc = render(RULE_VALUES).of_kind("PrometheusRule")[0]
    return rule


@pytest.mark.parametrize(
    ("kind", "path", "bad"),
    [
        ("LeaderWorkerSet", ("spec", "leaderWorkerTemplate", "restartPolicy"), "Always"),
        ("LeaderWorkerSet", ("spec", "leaderWorkerTemplate", "sizes"), 2),
        ("LeaderWorkerSet", ("spec", "leaderWorkerTemplate", "workerTemplate", "spec", "x"), 1),
        ("ScaledObject", ("spec", "triggers", 0, "metadata", "threshold"), 5),
        ("ScaledObject", ("spec", "maxReplicaCount"), 0),
        ("InferencePool", ("spec", "targetPorts"), []),
        ("InferencePool", ("spec", "appProtocol"), "grpc"),
    ],
)
def test_custom_resource_schemas_catch_bad_fields(
    custom_resources: Manifests, kind: str, path: tuple[Any, ...], bad: Any
) -> None:
    """The CRD schemas are not a no-op: each corruption of a rendered custom resource fails."""
    import kubernetes_validate

    doc = copy.deepcopy(custom_resources.of_kind(kind)[0])
    validate_doc(doc)  # as rendered: valid
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = bad
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate_doc(doc)


def test_validation_catches_a_bad_manifest(default_manifests: Manifests) -> None:
    """The validator is not a no-op: a corrupted Deployment and ServiceMonitor are rejected."""
    import kubernetes_validate

    deployment = yaml.safe_load(yaml.safe_dump(default_manifests.of_kind("Deployment")[0]))
    deployment["spec"]["template"]["spec"]["containers"][0]["bogusField"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_doc(deployment)
    monitor = render({"metrics": {"serviceMonitor": {"enabled": True}}}).of_kind("ServiceMonitor")
    monitor[0]["spec"]["endpoints"][0]["interval"] = "soon"
    with pytest.raises(jsonschema.ValidationError):
        validate_doc(monitor[0])


def _balanced(expr: str) -> bool:
    pairs = {")": "(", "]": "[", "}": "{"}
    stack: list[str] = []
    for ch in re.sub(r'"[^"]*"', "", expr):
        if ch in "([{":
            stack.append(ch)
        elif ch in pairs and (not stack or stack.pop() != pairs[ch]):
            return False
    return not stack


def test_prometheus_rule_alerts_cover_the_vllm_signals(prometheus_rule: Doc) -> None:
    rules = prometheus_rule["spec"]["groups"][0]["rules"]
    exprs = {r["alert"]: r["expr"] for r in rules}
    assert "vllm:e2e_request_latency_seconds_bucket" in exprs["SplitserveHighE2ELatencyP99"]
    assert "histogram_quantile(0.99" in exprs["SplitserveHighE2ELatencyP99"]
    assert "vllm:kv_cache_usage_perc" in exprs["SplitserveKVCacheAlmostFull"]
    assert exprs["SplitserveKVCacheAlmostFull"].endswith("> 0.95")
    assert "vllm:num_requests_waiting" in exprs["SplitserveRequestsWaiting"]
    assert "rate(vllm:num_preemptions_total" in exprs["SplitserveHighPreemptionRate"]
    for name, expr in exprs.items():
        assert _balanced(expr), f"{name}: unbalanced brackets in {expr!r}"
        # Scoped to this release's series.
        assert 'service="splitserve-metrics"' in expr and 'namespace="llm"' in expr, name
    for r in rules:
        assert r["labels"]["severity"] in {"info", "warning", "critical"}
        assert "{{ $labels" in r["annotations"]["summary"] or r["alert"] == "SplitserveTargetDown"


def test_prometheus_rule_thresholds_and_switches_come_from_values() -> None:
    rule = render(
        {
            "metrics": {
                "prometheusRule": {
                    "enabled": True,
                    "alerts": {
                        "kvCacheUsage": {"threshold": 0.9, "for": "2m"},
                        "preemptionRate": {"enabled": False},
                    },
                }
            }
        }
    ).of_kind("PrometheusRule")[0]
    rules = {r["alert"]: r for r in rule["spec"]["groups"][0]["rules"]}
    assert rules["SplitserveKVCacheAlmostFull"]["expr"].endswith("> 0.9")
    assert rules["SplitserveKVCacheAlmostFull"]["for"] == "2m"
    assert "SplitserveHighPreemptionRate" not in rules


def test_promtool_accepts_the_rules(tmp_path: Path, prometheus_rule: Doc) -> None:
    """promtool (Debian `prometheus`, installed by .ci/run) parses every expression."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    rules_file = tmp_path / "rules.yml"
    rules_file.write_text(yaml.safe_dump(prometheus_rule["spec"]))
    result = subprocess.run(
        [promtool, "check", "rules", str(rules_file)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_requests_waiting_alert_counts_an_engine_once(tmp_path: Path, prometheus_rule: Doc) -> None:
    """Only the engine core exports vllm:num_requests_waiting on the scraped ports, so the
    alert sums by engine (as vLLM's): 30 waiting in each of two engines is no engine over 50,
    60 in one is (promtool test rules)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(prometheus_rule["spec"]))
    labels = 'model_name="m", namespace="llm", service="splitserve-metrics"'
    series = [
        {
            "series": f'vllm:num_requests_waiting{{{labels}, engine="{engine}", pod="{pod}"}}',
            "values": f"{n}x10",
        }
        for pod, engine, n in (("core-a", "0", 30), ("core-b", "1", 30))
    ]
    engine = {"model_name": "m", "engine": "0", "severity": "warning"}
    notes = {
        "summary": "More than 50 requests are waiting in engine 0 (m)",
        "description": "vllm:num_requests_waiting has been 60 for 5m; the engine is saturated.",
    }
    test = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [
                    {"eval_time": "10m", "alertname": "SplitserveRequestsWaiting", "exp_alerts": []}
                ],
            },
            {
                "interval": "1m",
                "input_series": [{**series[0], "values": "60x10"}, series[1]],
                "alert_rule_test": [
                    {
                        "eval_time": "10m",
                        "alertname": "SplitserveRequestsWaiting",
                        "exp_alerts": [{"exp_labels": engine, "exp_annotations": notes}],
                    }
                ],
            },
        ],
    }
    (tmp_path / "test.yml").write_text(yaml.safe_dump(test))
    result = subprocess.run(
        [promtool, "test", "rules", "test.yml"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr

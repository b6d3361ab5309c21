"""`helm lint --strict` and `helm template` of the chart, for the defaults and every ci/ values file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helm.chart_render import (
    CHART_DIR,
    KUBE_VERSION,
    ci_values_files,
    load_values,
    render,
    render_files,
)
from tests.helm.security_values import GIVEN, TLS_OFF

VALUES_CASES = [pytest.param(None, id="defaults")] + [
    pytest.param(path, id=path.name) for path in ci_values_files()
]
SECURITY_CASES = [pytest.param(TLS_OFF, id="internal-tls-off"), pytest.param(GIVEN, id="given")]


def lint(values: dict[str, Any] | None) -> dict[str, Any]:
    import helm_python as helm

    report: dict[str, Any] = helm.lint(
        str(CHART_DIR), values, strict=True, kube_version=f"v{KUBE_VERSION}"
    )
    return report


def test_ci_folder_has_the_values_files_the_issue_asks_for() -> None:
    names = {p.name for p in ci_values_files()}
    assert "gpu-tp2-pp2-values.yaml" in names
    assert "cpu-values.yaml" in names


@pytest.mark.parametrize("values_file", VALUES_CASES)
def test_helm_lint_strict_is_clean(values_file: Path | None) -> None:
    report = lint(load_values(values_file) if values_file else None)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["total_charts_linted"] == 1
    assert not report["errors"], report["errors"]
    assert not problems, problems


@pytest.mark.parametrize("values", SECURITY_CASES)
def test_helm_lint_strict_is_clean_for_the_security_options(values: dict[str, Any]) -> None:
    report = lint(values)
    assert not report["errors"], report["errors"]
    assert not [m for m in report["messages"] if m["severity"] >= 2]


def test_helm_lint_strict_fails_on_a_broken_values_file() -> None:
    report = lint({"parallelism": {"tensorParallelSize": 0}})
    assert report["errors"] or any(m["severity"] >= 3 for m in report["messages"])


@pytest.mark.parametrize("values_file", VALUES_CASES)
def test_helm_template_renders_the_expected_objects(values_file: Path | None) -> None:
    manifests = render(load_values(values_file) if values_file else None)
    kinds = {d["kind"] for d in manifests.docs}
    assert {
        "Deployment",
        "Service",
        "ConfigMap",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "ServiceAccount",
    } <= kinds
    assert kinds & {"StatefulSet", "LeaderWorkerSet"}, "no worker workload"
    names = [(d["kind"], d["metadata"]["name"]) for d in manifests.docs]
    assert len(names) == len(set(names)), "two objects share a kind and name"
    for doc in manifests.docs:
        assert len(doc["metadata"]["name"]) <= 63, doc["metadata"]["name"]


def test_notes_name_the_layout_and_how_to_connect() -> None:
    notes = render_files({"parallelism": {"tensorParallelSize": 2, "pipelineParallelSize": 2}})
    text = next(v for k, v in notes.items() if k.endswith("NOTES.txt"))
    assert "4 worker rank(s) = tensor-parallel 2 x pipeline-parallel 2" in text
    assert "port-forward service/splitserve-frontend" in text


def test_long_release_names_stay_valid_dns_labels() -> None:
    name = "a-really-long-release-name-for-a-very-large-model-deployment"
    manifests = render(
        {"parallelism": {"tensorParallelSize": 8, "pipelineParallelSize": 2}}, name=name
    )
    sts = manifests.of_kind("StatefulSet")[0]
    # The highest ordinal's pod name is the pod's hostname: a DNS label of at most 63 chars.
    assert len(f"{sts['metadata']['name']}-15") <= 63
    for doc in manifests.docs:
        assert len(doc["metadata"]["name"]) <= 63, doc["metadata"]["name"]

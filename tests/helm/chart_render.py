"""Render the splitserve Helm chart in-process (helm-python-sdk) and look into the manifests."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "helm" / "splitserve"
CI_DIR = CHART_DIR / "ci"
RELEASE = "splitserve"
NAMESPACE = "llm"
KUBE_VERSION = "1.30.0"
CLUSTER_DOMAIN = "cluster.local"
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job", "LeaderWorkerSet")
# The argument that separates the ranks' command lines in a tpGroup worker container (_worker.tpl).
RANK_SEPARATOR = ";"

Doc = dict[str, Any]
# PyYAML's safe loader, in C (libyaml) where PyYAML has it: the same documents, about ten times
# faster than the pure-Python one on the hundreds of renderings the helm tests parse.
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def ci_values_files() -> list[Path]:
    """The chart-testing values files (ci/*-values.yaml)."""
    return sorted(CI_DIR.glob("*-values.yaml"))


def load_values(path: Path) -> dict[str, Any]:
    loaded = yaml.safe_load(path.read_text()) or {}
    assert isinstance(loaded, dict), f"{path} is not a mapping"
    return loaded


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """`override` merged into a copy of `base` (mappings recursively, everything else replaced)."""
    merged = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def render_files(
    values: Mapping[str, Any] | None = None, *, name: str = RELEASE, namespace: str = NAMESPACE
) -> dict[str, str]:
    """`helm template`: template path -> rendered text (user values over the chart defaults)."""
    import helm_python as helm

    with helm.Chart.load(str(CHART_DIR)) as chart:
        rendered: dict[str, str] = chart.render(
            dict(values or {}), name=name, namespace=namespace, is_install=True
        )
    return rendered


@dataclass
class Manifests:
    """The parsed documents of one rendering."""

    docs: list[Doc]
    namespace: str = NAMESPACE
    release: str = RELEASE

    def of_kind(self, kind: str) -> list[Doc]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name: str) -> Doc:
        for doc in self.of_kind(kind):
            if doc["metadata"]["name"] == name:
                return doc
        raise KeyError(
            f"no {kind} named {name!r}; have {[d['metadata']['name'] for d in self.of_kind(kind)]}"
        )

    def workloads(self) -> list[Doc]:
        return [d for d in self.docs if d["kind"] in WORKLOAD_KINDS]

    def workload(self, component: str) -> Doc:
        """The Deployment / StatefulSet of a component (frontend, core, worker)."""
        found = [w for w in self.workloads() if component_of(w) == component]
        assert len(found) == 1, f"expected one {component} workload, found {len(found)}"
        return found[0]

    def containers(self) -> Iterator[tuple[Doc, Doc]]:
        """(workload, container) for every container of every pod template of every workload."""
        for workload in self.workloads():
            for spec in pod_specs(workload):
                for container in [*spec.get("initContainers", []), *spec["containers"]]:
                    yield workload, container

    def main_containers(self) -> Iterator[tuple[Doc, Doc]]:
        """(workload, container) for every long-running (not init) container."""
        for workload in self.workloads():
            for spec in pod_specs(workload):
                for container in spec["containers"]:
                    yield workload, container

    def configmap_data(self, name: str) -> dict[str, str]:
        data = self.get("ConfigMap", name).get("data") or {}
        return {str(k): str(v) for k, v in data.items()}


def component_of(doc: Doc) -> str:
    return str(doc["metadata"].get("labels", {}).get("app.kubernetes.io/component", ""))


def pod_template(workload: Doc) -> Doc:
    """The PodTemplateSpec of a workload (a LeaderWorkerSet's worker template)."""
    if workload["kind"] == "LeaderWorkerSet":
        template: Doc = workload["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    else:
        template = workload["spec"]["template"]
    return template


def pod_spec(workload: Doc) -> Doc:
    spec: Doc = pod_template(workload)["spec"]
    return spec


def pod_specs(workload: Doc) -> list[Doc]:
    """Every PodSpec of a workload: a LeaderWorkerSet's leader template too, when it has one
    (an engine group's leader pod: engine core and frontend)."""
    leader = workload["spec"].get("leaderWorkerTemplate", {}).get("leaderTemplate")
    return [*([leader["spec"]] if leader else []), pod_spec(workload)]


def pod_labels(workload: Doc) -> dict[str, str]:
    labels: dict[str, str] = pod_template(workload)["metadata"]["labels"]
    return labels


@dataclass(frozen=True)
class Process:
    """One process a container runs: its argv and the environment its launcher adds."""

    argv: list[str]
    env: dict[str, str]


def container_processes(container: Doc) -> list[Process]:
    """The processes of a container: its command + args, or, for a tpGroup worker container (a
    bash supervisor), each rank's command line (`[env VAR=VALUE ...] splitserve worker ...`)."""
    command, args = list(container["command"]), list(container.get("args", []))
    if command[:2] != ["bash", "-c"]:
        return [Process(command + args, {})]
    groups: list[list[str]] = [[]]
    for arg in args:
        if arg == RANK_SEPARATOR:
            groups.append([])
        else:
            groups[-1].append(arg)
    processes = []
    for group in groups:
        env = {}
        if group and group[0] == "env":
            group = group[1:]
            while group and "=" in group[0]:
                key, _, value = group.pop(0).partition("=")
                env[key] = value
        processes.append(Process(group, env))
    return processes


def only_container(workload: Doc) -> Doc:
    containers = pod_spec(workload)["containers"]
    assert len(containers) == 1, f"{workload['metadata']['name']} has {len(containers)} containers"
    container: Doc = containers[0]
    return container


def container_port(container: Doc, name: str) -> int:
    for port in container.get("ports", []):
        if port.get("name") == name:
            return int(port["containerPort"])
    raise KeyError(f"container {container['name']} has no port named {name!r}")


def container_env(manifests: Manifests, container: Doc) -> dict[str, str]:
    """The container's environment as Kubernetes builds it (envFrom ConfigMaps, then env)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(manifests.configmap_data(source["configMapRef"]["name"]))
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = str(var["value"])
        elif "configMapKeyRef" in var.get("valueFrom", {}):
            ref = var["valueFrom"]["configMapKeyRef"]
            env[var["name"]] = manifests.configmap_data(ref["name"])[ref["key"]]
    return env


def labels_match(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def flag_value(args: list[str], flag: str) -> str | None:
    """Value of `--flag VALUE` or `--flag=VALUE` in an argument list (last one wins)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def render(
    values: Mapping[str, Any] | None = None, *, name: str = RELEASE, namespace: str = NAMESPACE
) -> Manifests:
    """Render and parse every Kubernetes document (NOTES.txt and empty documents left out)."""
    docs: list[Doc] = []
    for path, text in sorted(render_files(values, name=name, namespace=namespace).items()):
        if not path.endswith((".yaml", ".yml")):
            continue
        for doc in yaml.load_all(text, Loader=SAFE_LOADER):
            if doc:
                assert isinstance(doc, dict) and "kind" in doc, f"{path}: not a manifest: {doc!r}"
                docs.append(doc)
    return Manifests(docs, namespace=namespace, release=name)


def render_values_file(path: Path, extra: Mapping[str, Any] | None = None) -> Manifests:
    return render(deep_merge(load_values(path), extra or {}))

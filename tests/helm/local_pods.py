"""The pods a rendered chart asks for, as local_cluster.py runs them: one LocalPod per pod a
controller would create (Deployment and StatefulSet replicas, every pod of a LeaderWorkerSet
group with the labels and environment the LWS controller adds), each with its init containers
and its long-running container prepared as local command lines. A pod of several long-running
containers (an engine group's leader: engine core and frontend) is one LocalPod per container,
sharing the pod's name, folder, volumes and port space (containerPort -> loopback port), as the
containers of a pod share its network namespace; its init containers run once, with the first."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from tests.helm.chart_render import Doc, Manifests, component_of

LOOPBACK = "127.0.0.1"
# Labels and environment the LeaderWorkerSet controller gives its pods (sigs.k8s.io/lws).
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"


class WiringError(AssertionError):
    """The manifests would not work in a cluster (found before or while starting the pods)."""


class PodFailed(AssertionError):
    """A pod's process exited or did not become ready."""


@dataclass
class ContainerRun:
    """One container of a pod, prepared to run locally."""

    name: str
    mounts: list[tuple[str, Path]]  # (mountPath, folder), longest path first
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class LocalPod:
    """One pod: its init containers run to completion, then its one container as a process."""

    name: str
    workload: Doc
    ordinal: int
    root: Path
    template: Doc  # the PodTemplateSpec the pod was made from
    subdomain: str = ""  # the headless Service its hostname resolves under ("" = none)
    controller_labels: dict[str, str] = field(default_factory=dict)
    controller_env: dict[str, str] = field(default_factory=dict)
    ports: dict[int, int] = field(default_factory=dict)  # containerPort -> loopback port
    port_names: dict[str, int] = field(default_factory=dict)  # port name -> containerPort
    init: list[ContainerRun] = field(default_factory=list)
    main: ContainerRun | None = None
    process: subprocess.Popen[bytes] | None = None
    container_index: int = 0
    """Which of the pod's long-running containers this one runs."""

    @property
    def is_multi_container(self) -> bool:
        return len(self.spec["containers"]) > 1

    @property
    def component(self) -> str:
        """The pod's component (its template's label: an engine group's worker pods are
        "worker"); in a pod of several containers, the container's name."""
        if self.is_multi_container:
            return str(self.container["name"])
        label = self.template["metadata"].get("labels", {}).get("app.kubernetes.io/component")
        return str(label) if label else component_of(self.workload)

    @property
    def labels(self) -> dict[str, str]:
        return {**self.template["metadata"]["labels"], **self.controller_labels}

    @property
    def spec(self) -> Doc:
        spec: Doc = self.template["spec"]
        return spec

    @property
    def container(self) -> Doc:
        container: Doc = self.spec["containers"][self.container_index]
        return container

    @property
    def init_containers(self) -> list[Doc]:
        """The pod's init containers (run once per pod: with its first container)."""
        return list(self.spec.get("initContainers", [])) if self.container_index == 0 else []

    @property
    def argv(self) -> list[str]:
        return self.main.argv if self.main else []

    @property
    def env(self) -> dict[str, str]:
        return self.main.env if self.main else {}

    @property
    def mounts(self) -> list[tuple[str, Path]]:
        return self.main.mounts if self.main else []

    @property
    def log_path(self) -> Path:
        if self.is_multi_container:
            return self.root / f"{self.container['name']}.log"
        return self.root / "container.log"

    def log_tail(self, lines: int = 60) -> str:
        if not self.log_path.exists():
            return "(no output)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def loopback_port(self, container_port: int | str) -> int:
        number = (
            self.port_names.get(container_port)
            if isinstance(container_port, str)
            else container_port
        )
        if number is None or number not in self.ports:
            raise WiringError(
                f"{self.name} declares no containerPort {container_port!r} (has {self.port_names})"
            )
        return self.ports[number]


def expand_pods(manifests: Manifests, workdir: Path) -> list[LocalPod]:
    """Every pod the workloads' controllers would create."""
    pods = []
    for workload in manifests.workloads():
        kind, name = workload["kind"], workload["metadata"]["name"]
        if kind == "LeaderWorkerSet":
            pods += _leader_worker_pods(workload, manifests.namespace, workdir)
        elif kind in ("Deployment", "StatefulSet"):
            subdomain = workload["spec"].get("serviceName", "") if kind == "StatefulSet" else ""
            for ordinal in range(int(workload["spec"].get("replicas", 1))):
                pod_name = f"{name}-{ordinal}"
                pod = LocalPod(
                    pod_name,
                    workload,
                    ordinal,
                    _pod_root(workdir, pod_name),
                    workload["spec"]["template"],
                    subdomain,
                )
                pods += with_sidecars(pod)
        else:
            raise WiringError(f"{kind}/{name}: not emulated")
    return pods


def _leader_worker_pods(workload: Doc, namespace: str, workdir: Path) -> list[LocalPod]:
    """Group g of size n: leader "<lws>-g" (worker index 0), workers "<lws>-g-i"; all resolve
    under the headless Service "<lws>" the controller creates (subdomainPolicy Shared)."""
    name, spec = workload["metadata"]["name"], workload["spec"]
    group = spec["leaderWorkerTemplate"]
    size = int(group.get("size", 1))
    if spec.get("networkConfig", {}).get("subdomainPolicy", "Shared") != "Shared":
        raise WiringError(f"LeaderWorkerSet/{name}: only subdomainPolicy Shared is emulated")
    pods = []
    for g in range(int(spec.get("replicas", 1))):
        for index in range(size):
            pod_name = f"{name}-{g}" if index == 0 else f"{name}-{g}-{index}"
            template = group.get("leaderTemplate") if index == 0 else None
            pod = LocalPod(
                pod_name,
                workload,
                index,
                _pod_root(workdir, pod_name),
                template or group["workerTemplate"],
                subdomain=name,
                controller_labels={
                    LWS_NAME_LABEL: name,
                    LWS_GROUP_INDEX_LABEL: str(g),
                    LWS_WORKER_INDEX_LABEL: str(index),
                },
                controller_env={
                    "LWS_LEADER_ADDRESS": f"{name}-{g}.{name}.{namespace}",
                    "LWS_GROUP_SIZE": str(size),
                    "LWS_WORKER_INDEX": str(index),
                },
            )
            pods += with_sidecars(pod)
    return pods


def with_sidecars(pod: LocalPod) -> list[LocalPod]:
    """`pod` and one more LocalPod for each further container of its pod, sharing its port
    space (the same dicts) and folder."""
    siblings = [
        replace(pod, container_index=i, ports=pod.ports, port_names=pod.port_names)
        for i in range(1, len(pod.spec["containers"]))
    ]
    return [pod, *siblings]


def _pod_root(workdir: Path, pod_name: str) -> Path:
    root = workdir / "pods" / pod_name
    root.mkdir(parents=True)
    return root


def expand_refs(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command, args and env values ($$ escapes)."""

    def sub(match: re.Match[str]) -> str:
        if match.group(0).startswith("$$"):
            return match.group(0)[1:]
        return env.get(match["name"], match.group(0))

    return re.sub(
        r"\$\$\([A-Za-z_][A-Za-z0-9_]*\)|\$\((?P<name>[A-Za-z_][A-Za-z0-9_]*)\)", sub, text
    )

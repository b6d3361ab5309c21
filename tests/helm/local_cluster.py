"""Run a rendered chart's pods as local processes, as Kubernetes would wire them.

Every pod of every Deployment / StatefulSet becomes one process started from its container's
`command`, `args` and environment (envFrom ConfigMaps and Secrets, env values and references,
`$(VAR)` expansion, Service-link variables unless `enableServiceLinks: false`). The cluster's
network and storage are mapped onto the local machine:

* every declared containerPort of every pod gets its own free loopback port; a `--*-port` flag
  that names one is rewritten to it, and listen address 0.0.0.0 becomes 127.0.0.1;
* every `HOST:PORT` in args or env whose HOST is a cluster DNS name - a Service
  (`svc`, `svc.ns`, `svc.ns.svc`, `svc.ns.svc.<domain>`, port -> targetPort) or a pod behind a
  headless Service (`pod.svc...`, StatefulSets) - is rewritten to the loopback port of the pod it
  reaches; an unresolvable name is a wiring error;
* every volume becomes a folder (emptyDir: per pod; PVC: shared per claim; hostPath: itself;
  ConfigMap / Secret: files) and every absolute path in args or env is translated through the
  container's volume mounts; a path on no volume would be on the read-only root filesystem and is a
  wiring error.

Readiness is what the pods' own gRPC probes say. Processes are stopped by PID.
"""

from __future__ import annotations

import base64
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.helm.chart_render import Doc, Manifests, component_of, pod_spec

LOOPBACK = "127.0.0.1"
ADDRESS = re.compile(
    r"(?<![\w.-])(?P<host>[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?):"
    r"(?P<port>\d{1,5})(?![\w.])"
)
# Environment twins of the services' listen-port flags (--port, --metrics-port).
LISTEN_PORT_ENV = {"SPLITSERVE_PORT", "SPLITSERVE_METRICS_PORT"}
IP = re.compile(r"^\d+\.\d+\.\d+\.\d+$")


class WiringError(AssertionError):
    """The manifests would not work in a cluster (found before or while starting the pods)."""


class PodFailed(AssertionError):
    """A pod's process exited or did not become ready."""


def free_ports(count: int) -> list[int]:
    """Loopback ports that are free right now (held open together, so they differ)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind((LOOPBACK, 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass
class LocalPod:
    """One pod of a workload, run as one local process (single-container pods only)."""

    name: str
    workload: Doc
    ordinal: int
    root: Path
    ports: dict[int, int] = field(default_factory=dict)  # containerPort -> loopback port
    port_names: dict[str, int] = field(default_factory=dict)  # port name -> containerPort
    mounts: list[tuple[str, Path]] = field(default_factory=list)  # (mountPath, folder)
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None

    @property
    def component(self) -> str:
        return component_of(self.workload)

    @property
    def labels(self) -> dict[str, str]:
        labels: dict[str, str] = self.workload["spec"]["template"]["metadata"]["labels"]
        return labels

    @property
    def spec(self) -> Doc:
        return pod_spec(self.workload)

    @property
    def container(self) -> Doc:
        containers = self.spec["containers"]
        if len(containers) != 1 or self.spec.get("initContainers"):
            raise WiringError(f"{self.name}: only single-container pods are emulated")
        container: Doc = containers[0]
        return container

    @property
    def log_path(self) -> Path:
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


class LocalCluster:
    """The pods of one rendering, wired on loopback."""

    def __init__(
        self,
        manifests: Manifests,
        workdir: Path,
        bin_dir: Path,
        cluster_domain: str = "cluster.local",
    ) -> None:
        self.manifests = manifests
        self.namespace = manifests.namespace
        self.domain = cluster_domain
        self.workdir = workdir
        self.bin_dir = bin_dir
        self.pods = self._expand_pods()
        self._assign_ports()
        self._dns = self._build_dns()
        for pod in self.pods:
            self._prepare(pod)

    # -- set-up ---------------------------------------------------------------------------

    def _expand_pods(self) -> list[LocalPod]:
        pods = []
        for workload in self.manifests.workloads():
            kind, name = workload["kind"], workload["metadata"]["name"]
            if kind not in ("Deployment", "StatefulSet"):
                raise WiringError(f"{kind}/{name}: not emulated")
            replicas = int(workload["spec"].get("replicas", 1))
            for ordinal in range(replicas):
                pod_name = f"{name}-{ordinal}"
                root = self.workdir / "pods" / pod_name
                root.mkdir(parents=True)
                pods.append(LocalPod(pod_name, workload, ordinal, root))
        return pods

    def _assign_ports(self) -> None:
        declared = [(pod, p) for pod in self.pods for p in pod.container.get("ports", [])]
        for (pod, port), local in zip(declared, free_ports(len(declared)), strict=True):
            pod.ports[int(port["containerPort"])] = local
            if "name" in port:
                pod.port_names[port["name"]] = int(port["containerPort"])

    def _dns_forms(self, name: str) -> list[str]:
        ns = self.namespace
        return [name, f"{name}.{ns}", f"{name}.{ns}.svc", f"{name}.{ns}.svc.{self.domain}"]

    def _build_dns(self) -> dict[str, tuple[str, Doc | LocalPod]]:
        """DNS name -> ("service", Service) for ClusterIP Services, ("pod", pod) for the pods a
        headless Service names (StatefulSet pods: hostname = pod name, subdomain = serviceName)."""
        dns: dict[str, tuple[str, Doc | LocalPod]] = {}
        for svc in self.manifests.of_kind("Service"):
            name = svc["metadata"]["name"]
            if svc["spec"].get("clusterIP") != "None":
                for form in self._dns_forms(name):
                    dns[form] = ("service", svc)
                continue
            for pod in self.selected(svc):
                if pod.workload["kind"] == "StatefulSet" and (
                    pod.workload["spec"]["serviceName"] == name
                ):
                    for form in self._dns_forms(f"{pod.name}.{name}"):
                        dns[form] = ("pod", pod)
        return dns

    def selected(self, service: Doc) -> list[LocalPod]:
        selector = service["spec"].get("selector") or {}
        return [
            p
            for p in self.pods
            if selector and all(p.labels.get(k) == v for k, v in selector.items())
        ]

    def _volumes(self, pod: LocalPod) -> dict[str, Path]:
        folders: dict[str, Path] = {}
        for volume in pod.spec.get("volumes", []):
            name = volume["name"]
            if "emptyDir" in volume:
                folder = pod.root / "volumes" / name
                folder.mkdir(parents=True)
            elif "hostPath" in volume:
                folder = Path(volume["hostPath"]["path"])
                if volume["hostPath"].get("type") == "Directory" and not folder.is_dir():
                    raise WiringError(f"{pod.name}: hostPath {folder} does not exist")
            elif "persistentVolumeClaim" in volume:
                folder = self.workdir / "pvcs" / volume["persistentVolumeClaim"]["claimName"]
                folder.mkdir(parents=True, exist_ok=True)
            elif "configMap" in volume or "secret" in volume:
                folder = pod.root / "volumes" / name
                folder.mkdir(parents=True)
                for key, value in self._object_data(volume).items():
                    (folder / key).write_text(value)
            else:
                raise WiringError(f"{pod.name}: volume {name} of an unsupported type")
            folders[name] = folder
        return folders

    def _object_data(self, volume: Doc) -> dict[str, str]:
        if "configMap" in volume:
            return self.manifests.configmap_data(volume["configMap"]["name"])
        return self._secret_data(volume["secret"]["secretName"])

    def _secret_data(self, name: str) -> dict[str, str]:
        secret = self.manifests.get("Secret", name)
        data = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
        data.update(secret.get("stringData") or {})
        return data

    def _service_link_env(self) -> dict[str, str]:
        """What the kubelet injects for every ClusterIP Service when enableServiceLinks is on."""
        env: dict[str, str] = {}
        services = [
            s for s in self.manifests.of_kind("Service") if s["spec"].get("clusterIP") != "None"
        ]
        for index, svc in enumerate(services):
            prefix = svc["metadata"]["name"].upper().replace("-", "_")
            ip = f"10.96.0.{index + 10}"
            ports = svc["spec"]["ports"]
            env[f"{prefix}_SERVICE_HOST"] = ip
            env[f"{prefix}_SERVICE_PORT"] = str(ports[0]["port"])
            env[f"{prefix}_PORT"] = f"tcp://{ip}:{ports[0]['port']}"
            for port in ports:
                proto = port.get("protocol", "TCP")
                base = f"{prefix}_PORT_{port['port']}_{proto}"
                env[base] = f"{proto.lower()}://{ip}:{port['port']}"
                env[f"{base}_PROTO"] = proto.lower()
                env[f"{base}_PORT"] = str(port["port"])
                env[f"{base}_ADDR"] = ip
                if "name" in port:
                    env[f"{prefix}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}"] = str(
                        port["port"]
                    )
        return env

    def _container_env(self, pod: LocalPod) -> dict[str, str]:
        env: dict[str, str] = {}
        if pod.spec.get("enableServiceLinks", True):
            env.update(self._service_link_env())
        for source in pod.container.get("envFrom", []):
            prefix = source.get("prefix", "")
            if "configMapRef" in source:
                data = self.manifests.configmap_data(source["configMapRef"]["name"])
            else:
                data = self._secret_data(source["secretRef"]["name"])
            env.update({prefix + k: v for k, v in data.items()})
        for var in pod.container.get("env", []):
            env[var["name"]] = self._env_value(pod, var, env)
        return env

    def _env_value(self, pod: LocalPod, var: Doc, env: Mapping[str, str]) -> str:
        if "value" in var:
            return expand_refs(str(var["value"]), env)
        ref = var.get("valueFrom", {})
        if "configMapKeyRef" in ref:
            key = ref["configMapKeyRef"]
            return self.manifests.configmap_data(key["name"])[key["key"]]
        if "secretKeyRef" in ref:
            key = ref["secretKeyRef"]
            return self._secret_data(key["name"])[key["key"]]
        if "fieldRef" in ref:
            path = ref["fieldRef"]["fieldPath"]
            fields = {
                "metadata.name": pod.name,
                "metadata.namespace": self.namespace,
                "status.podIP": LOOPBACK,
                "status.hostIP": LOOPBACK,
                "spec.nodeName": "local-node",
                "spec.serviceAccountName": pod.spec.get("serviceAccountName", "default"),
            }
            if path not in fields:
                raise WiringError(f"{pod.name}: fieldRef {path} is not emulated")
            return fields[path]
        return ""

    def _prepare(self, pod: LocalPod) -> None:
        folders = self._volumes(pod)
        for mount in pod.container.get("volumeMounts", []):
            if mount["name"] not in folders:
                raise WiringError(f"{pod.name}: volumeMount {mount['name']} has no volume")
            folder = folders[mount["name"]] / mount.get("subPath", "")
            pod.mounts.append((mount["mountPath"].rstrip("/") or "/", folder))
        pod.mounts.sort(key=lambda m: len(m[0]), reverse=True)
        env = self._container_env(pod)
        pod.env = {k: self._rewrite_env(pod, k, v) for k, v in env.items()}
        command = [expand_refs(c, env) for c in pod.container.get("command", [])]
        args = [expand_refs(a, env) for a in pod.container.get("args", [])]
        if not command:
            raise WiringError(f"{pod.name}: no command (the image's ENTRYPOINT is not emulated)")
        pod.argv = [
            self._executable(pod, command[0]),
            *self._rewrite_args(pod, [*command[1:], *args]),
        ]

    # -- rewriting ------------------------------------------------------------------------

    def _executable(self, pod: LocalPod, name: str) -> str:
        if name in ("python", "python3", "python3.11"):
            return sys.executable
        local = self.bin_dir / Path(name).name
        if not local.exists():
            raise WiringError(f"{pod.name}: command {name!r} is not installed here")
        return str(local)

    def translate_path(self, pod: LocalPod, path: str, what: str) -> str:
        for mount_path, folder in pod.mounts:
            if path == mount_path or path.startswith(mount_path + "/"):
                return str(folder) + path[len(mount_path) :]
        raise WiringError(
            f"{pod.name}: {what} uses {path}, which is on no volume (the root "
            "filesystem is read-only)"
        )

    def _rewrite_value(self, pod: LocalPod, value: str, what: str) -> str:
        if value == "0.0.0.0":
            return LOOPBACK
        if value.startswith("/"):
            return self.translate_path(pod, value, what)

        def address(match: re.Match[str]) -> str:
            host, port = match["host"], int(match["port"])
            if IP.match(host) or host == "localhost":
                return match.group(0)
            return f"{LOOPBACK}:{self.resolve(host, port, what=f'{pod.name} {what}')}"

        return ADDRESS.sub(address, value)

    def _rewrite_env(self, pod: LocalPod, name: str, value: str) -> str:
        if name in LISTEN_PORT_ENV and value.isdigit():
            return str(pod.loopback_port(int(value)))
        return self._rewrite_value(pod, value, f"env {name}")

    def _rewrite_args(self, pod: LocalPod, args: list[str]) -> list[str]:
        out: list[str] = []
        listen_flag = False
        for arg in args:
            if listen_flag:
                out.append(str(pod.loopback_port(int(arg))))
                listen_flag = False
                continue
            flag, eq, value = arg.partition("=")
            if flag.startswith("--") and flag.endswith("port"):
                if not eq:
                    listen_flag = True
                    out.append(arg)
                else:
                    out.append(f"{flag}={pod.loopback_port(int(value))}")
                continue
            if flag.startswith("--") and eq:
                out.append(f"{flag}={self._rewrite_value(pod, value, flag)}")
            else:
                out.append(self._rewrite_value(pod, arg, "an argument"))
        return out

    def resolve(self, host: str, port: int, what: str = "client") -> int:
        """Loopback port behind cluster address host:port."""
        if host not in self._dns:
            raise WiringError(f"{what}: {host}:{port} does not resolve in the cluster")
        kind, target = self._dns[host]
        if kind == "pod":
            assert isinstance(target, LocalPod)
            return target.loopback_port(port)
        assert isinstance(target, dict)
        svc_port = next((p for p in target["spec"]["ports"] if int(p["port"]) == port), None)
        if svc_port is None:
            raise WiringError(f"{what}: Service {target['metadata']['name']} has no port {port}")
        backends = self.selected(target)
        if not backends:
            raise WiringError(f"{what}: Service {target['metadata']['name']} selects no pod")
        return backends[0].loopback_port(svc_port.get("targetPort", port))

    def address(self, host: str, port: int) -> str:
        return f"{LOOPBACK}:{self.resolve(host, port)}"

    # -- running --------------------------------------------------------------------------

    def start(self) -> None:
        """Start every pod at once, like Kubernetes does (no ordering between workloads)."""
        for pod in self.pods:
            self._run(pod)

    def _run(self, pod: LocalPod) -> None:
        base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
        with pod.log_path.open("ab") as log:
            pod.process = subprocess.Popen(
                pod.argv,
                env={**base, **pod.env},
                cwd=pod.root,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def restart(self, pod: LocalPod) -> None:
        """What the kubelet does when a container's liveness fails or it crashes: stop the
        process (SIGTERM, SIGKILL after the grace period) and start the container again, in the
        same pod (same name, ports and emptyDirs)."""
        if pod.process is not None:
            self._terminate([pod.process], self._grace([pod]))
        self._run(pod)

    def probe(self, pod: LocalPod, kind: str) -> bool:
        """Run the container's own probe once (gRPC probes only)."""
        probe = pod.container.get(kind)
        if probe is None:
            return True
        if "grpc" not in probe:
            raise WiringError(f"{pod.name}: {kind} is not a gRPC probe")
        target = f"{LOOPBACK}:{pod.loopback_port(int(probe['grpc']['port']))}"
        request = health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", ""))
        try:
            with grpc.insecure_channel(target) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=2.0)
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def check_alive(self) -> None:
        for pod in self.pods:
            code = pod.process.poll() if pod.process else None
            if code is not None:
                raise PodFailed(
                    f"{pod.name} exited with code {code}:\n{pod.log_tail()}\n{self.describe()}"
                )

    def wait_ready(self, timeout: float) -> None:
        """Until every pod's startup and readiness probes pass (and liveness holds)."""
        deadline = time.monotonic() + timeout
        pending = list(self.pods)
        while pending:
            self.check_alive()
            pending = [
                p
                for p in pending
                if not (self.probe(p, "startupProbe") and self.probe(p, "readinessProbe"))
            ]
            if pending and time.monotonic() > deadline:
                logs = "\n".join(f"--- {p.name} ---\n{p.log_tail()}" for p in pending)
                raise PodFailed(
                    f"not ready after {timeout:.0f} s: "
                    f"{[p.name for p in pending]}\n{logs}\n{self.describe()}"
                )
            if pending:
                time.sleep(0.5)
        not_live = [p.name for p in self.pods if not self.probe(p, "livenessProbe")]
        if not_live:
            raise PodFailed(f"liveness fails for ready pods {not_live}")

    def stop(self) -> None:
        """SIGTERM every process by PID (frontends first); SIGKILL what outlives its pod's
        terminationGracePeriodSeconds, as the kubelet does."""
        pods = [p for p in reversed(self.pods) if p.process]
        self._terminate([p.process for p in pods if p.process], self._grace(pods))

    @staticmethod
    def _grace(pods: list[LocalPod]) -> float:
        return max(
            (float(p.spec.get("terminationGracePeriodSeconds", 30)) for p in pods), default=30.0
        )

    @staticmethod
    def _terminate(processes: list[subprocess.Popen[bytes]], grace: float) -> None:
        running = [p for p in processes if p.poll() is None]
        for process in running:
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for process in running:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def describe(self) -> str:
        return "\n".join(f"{p.name}: {' '.join(p.argv)}" for p in self.pods)

    def pods_of(self, component: str) -> list[LocalPod]:
        return [p for p in self.pods if p.component == component]


def expand_refs(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command, args and env values ($$ escapes)."""

    def sub(match: re.Match[str]) -> str:
        if match.group(0).startswith("$$"):
            return match.group(0)[1:]
        return env.get(match["name"], match.group(0))

    return re.sub(
        r"\$\$\([A-Za-z_][A-Za-z0-9_]*\)|\$\((?P<name>[A-Za-z_][A-Za-z0-9_]*)\)", sub, text
    )


SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count"),
    "gauge": ("",),
    "untyped": ("",),
}


def metric_names(text: str) -> set[str]:
    """Series names a Prometheus scrape of this text can know: the samples, plus the sample names
    of every declared family (a labelled family may have no sample until its first event)."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(maxsplit=3)
            names.update(family + suffix for suffix in SAMPLE_SUFFIXES.get(kind, ("",)))
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names

"""Run a rendered chart's pods as local processes, as Kubernetes would wire them.

Every pod of every Deployment / StatefulSet / LeaderWorkerSet (local_pods.py) runs its init
containers to completion and then becomes one process started from its container's `command`,
`args` and environment (envFrom ConfigMaps and Secrets, env values and references, `$(VAR)`
expansion, Service-link variables unless `enableServiceLinks: false`), with the image's PATH
(the splitserve scripts first). The cluster's network and storage are mapped onto the local
machine:

* every declared containerPort of every pod gets its own free loopback port; a `--*-port` flag
  that names one is rewritten to it, and listen address 0.0.0.0 becomes 127.0.0.1;
* every `HOST:PORT` in args or env whose HOST is a cluster DNS name - a Service
  (`svc`, `svc.ns`, `svc.ns.svc`, `svc.ns.svc.<domain>`, port -> targetPort) or a pod behind a
  headless Service (`pod.svc...`: StatefulSets, and LeaderWorkerSets under the Service their
  controller creates) - is rewritten to the loopback port of the pod it reaches; an
  unresolvable name is a wiring error; `127.0.0.1:P` naming a port of the pod itself (or of
  another container of it: they share the pod's network) is rewritten to that port's;
* every volume becomes a folder (emptyDir: per pod; PVC: shared per claim; hostPath: itself;
  ConfigMap / Secret: files, only the listed `items` when there are some, a missing key a wiring
  error) and every absolute path in args or env is translated through the container's volume
  mounts; a path on no volume would be on the read-only root filesystem and is a
  wiring error. A path a process only forwards to other pods (the core's --model, which the
  workers open) is translated through those pods' mounts instead, and must mean one folder.

Readiness is what the pods' own probes say (gRPC, or HTTP GET over HTTP or HTTPS without
verifying the certificate, as the kubelet does). Stopping runs each container's preStop command
first, then SIGTERM, then SIGKILL at terminationGracePeriodSeconds counted from the preStop's
start, as the kubelet does. Processes are stopped by PID.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from splitserve.loopback_ports import free_ports
from tests.helm.chart_render import Doc, Manifests
from tests.helm.local_kubelet import run_probe, terminate
from tests.helm.local_pods import (
    LOOPBACK,
    ContainerRun,
    LocalPod,
    PodFailed,
    WiringError,
    expand_pods,
    expand_refs,
)

__all__ = ["LocalCluster", "LocalPod", "PodFailed", "WiringError", "metric_names"]
ADDRESS = re.compile(
    r"(?<![\w.-])(?P<host>[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?):"
    r"(?P<port>\d{1,5})(?![\w.])"
)
# Environment twins of the services' listen-port flags (--port, --metrics-port).
LISTEN_PORT_ENV = {"SPLITSERVE_PORT", "SPLITSERVE_METRICS_PORT"}
IP = re.compile(r"^\d+\.\d+\.\d+\.\d+$")
# Paths a component passes on to another component's pods, which open them: (component, flag).
FORWARDED_PATHS = {("core", "--model"): "worker"}
SHELLS = ("bash", "/bin/bash", "/usr/bin/bash", "sh", "/bin/sh")
# Other programs of the image a container's command or hook may run (from this machine's PATH).
IMAGE_TOOLS = ("sleep",)


class LocalCluster:
    """The pods of one rendering, wired on loopback."""

    def __init__(
        self,
        manifests: Manifests,
        workdir: Path,
        bin_dir: Path,
        cluster_domain: str = "cluster.local",
        secrets: Mapping[str, Mapping[str, str]] | None = None,
        init_env: Mapping[str, str] | None = None,
    ) -> None:
        """`secrets`: Secrets the user creates beside the release (name -> data); `init_env`:
        environment added to every init container (e.g. a stand-in for a network service)."""
        self.manifests = manifests
        self.namespace = manifests.namespace
        self.domain = cluster_domain
        self.workdir = workdir
        self.bin_dir = bin_dir
        self.secrets = {k: dict(v) for k, v in (secrets or {}).items()}
        self.init_env = dict(init_env or {})
        self.pods = expand_pods(manifests, workdir)
        self._pod_volumes: dict[Path, dict[str, Path]] = {}
        self._assign_ports()
        self._dns = self._build_dns()
        for pod in self.pods:
            self._mount(pod)
        for pod in self.pods:
            self._prepare(pod)

    # -- set-up ---------------------------------------------------------------------------

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
        headless Service names (hostname = pod name, subdomain = the StatefulSet's serviceName
        or the LeaderWorkerSet, whose controller creates that Service)."""
        dns: dict[str, tuple[str, Doc | LocalPod]] = {}
        for svc in self.manifests.of_kind("Service"):
            name = svc["metadata"]["name"]
            if svc["spec"].get("clusterIP") != "None":
                for form in self._dns_forms(name):
                    dns[form] = ("service", svc)
                continue
            for pod in self.selected(svc):
                if pod.workload["kind"] == "StatefulSet" and pod.subdomain == name:
                    for form in self._dns_forms(f"{pod.name}.{name}"):
                        dns[form] = ("pod", pod)
        for pod in self.pods:
            if pod.workload["kind"] == "LeaderWorkerSet":
                for form in self._dns_forms(f"{pod.name}.{pod.subdomain}"):
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
        """The pod's volumes as folders (made once per pod, shared by its containers)."""
        if pod.root not in self._pod_volumes:
            self._pod_volumes[pod.root] = self._make_volumes(pod)
        return self._pod_volumes[pod.root]

    def _make_volumes(self, pod: LocalPod) -> dict[str, Path]:
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
                data = self._object_data(volume)
                source = volume.get("configMap") or volume["secret"]
                items = source.get("items") or [{"key": k, "path": k} for k in data]
                for item in items:
                    if item["key"] not in data:
                        raise WiringError(f"{pod.name}: volume {name} has no key {item['key']}")
                    (folder / item["path"]).write_text(data[item["key"]])
            else:
                raise WiringError(f"{pod.name}: volume {name} of an unsupported type")
            folders[name] = folder
        return folders

    def _object_data(self, volume: Doc) -> dict[str, str]:
        if "configMap" in volume:
            return self.manifests.configmap_data(volume["configMap"]["name"])
        return self._secret_data(volume["secret"]["secretName"])

    def _secret_data(self, name: str) -> dict[str, str]:
        if name in self.secrets:
            return self.secrets[name]
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

    def _container_env(self, pod: LocalPod, container: Doc) -> dict[str, str]:
        env: dict[str, str] = {}
        if pod.spec.get("enableServiceLinks", True):
            env.update(self._service_link_env())
        for source in container.get("envFrom", []):
            prefix = source.get("prefix", "")
            if "configMapRef" in source:
                data = self.manifests.configmap_data(source["configMapRef"]["name"])
            else:
                data = self._secret_data(source["secretRef"]["name"])
            env.update({prefix + k: v for k, v in data.items()})
        env.update(pod.controller_env)
        for var in container.get("env", []):
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
            label = re.fullmatch(r"metadata\.labels\['([^']+)'\]", path)
            if label is not None and label[1] in pod.labels:
                return pod.labels[label[1]]
            if path not in fields:
                raise WiringError(f"{pod.name}: fieldRef {path} is not emulated")
            return fields[path]
        return ""

    def _mount(self, pod: LocalPod) -> None:
        """The pod's volumes as folders, and each container's mounts of them."""
        folders = self._volumes(pod)

        def mounts(container: Doc) -> list[tuple[str, Path]]:
            found = []
            for mount in container.get("volumeMounts", []):
                if mount["name"] not in folders:
                    raise WiringError(f"{pod.name}: volumeMount {mount['name']} has no volume")
                folder = folders[mount["name"]] / mount.get("subPath", "")
                found.append((mount["mountPath"].rstrip("/") or "/", folder))
            return sorted(found, key=lambda m: len(m[0]), reverse=True)

        pod.init = [ContainerRun(c["name"], mounts(c)) for c in pod.init_containers]
        pod.main = ContainerRun(pod.container["name"], mounts(pod.container))

    def _prepare(self, pod: LocalPod) -> None:
        assert pod.main is not None
        runs = [*pod.init, pod.main]
        for run, container in zip(runs, [*pod.init_containers, pod.container], strict=True):
            env = self._container_env(pod, container)
            run.env = {k: self._rewrite_env(pod, run, k, v) for k, v in env.items()}
            command = [expand_refs(c, env) for c in container.get("command", [])]
            args = [expand_refs(a, env) for a in container.get("args", [])]
            if not command:
                raise WiringError(
                    f"{pod.name}: no command (the image's ENTRYPOINT is not emulated)"
                )
            run.argv = [
                self._executable(pod, command[0]),
                *self._rewrite_args(pod, run, [*command[1:], *args]),
            ]

    # -- rewriting ------------------------------------------------------------------------

    def _executable(self, pod: LocalPod, name: str) -> str:
        if name in ("python", "python3", "python3.11"):
            return sys.executable
        if name in SHELLS or name in IMAGE_TOOLS:
            program = shutil.which(Path(name).name)
            if program is None:
                raise WiringError(f"{pod.name}: {name} is not installed here")
            return program
        local = self.bin_dir / Path(name).name
        if not local.exists():
            raise WiringError(f"{pod.name}: command {name!r} is not installed here")
        return str(local)

    def translate_path(self, pod: LocalPod, run: ContainerRun, path: str, what: str) -> str:
        for mount_path, folder in run.mounts:
            if path == mount_path or path.startswith(mount_path + "/"):
                return str(folder) + path[len(mount_path) :]
        raise WiringError(
            f"{pod.name}: {what} uses {path}, which is on no volume (the root "
            "filesystem is read-only)"
        )

    def _forwarded_path(self, pod: LocalPod, flag: str, path: str) -> str:
        """A path `pod` passes on in `flag` to the pods that open it: the same folder there.
        A spec that is no path (`tiny`, a Hub id) passes unchanged."""
        if not path.startswith("/"):
            return path
        opener = FORWARDED_PATHS[(pod.component, flag)]
        folders = {
            self.translate_path(p, p.main, path, f"{flag} of {pod.name}")
            for p in self.pods_of(opener)
            if p.main is not None
        }
        if len(folders) != 1:
            raise WiringError(f"{pod.name} {flag} {path}: not one folder in the {opener} pods")
        return folders.pop()

    def _rewrite_value(self, pod: LocalPod, run: ContainerRun, value: str, what: str) -> str:
        if value == "0.0.0.0":
            return LOOPBACK
        if value.startswith("/"):
            return self.translate_path(pod, run, value, what)

        def address(match: re.Match[str]) -> str:
            host, port = match["host"], int(match["port"])
            if host in (LOOPBACK, "localhost") and port in pod.ports:
                return f"{LOOPBACK}:{pod.ports[port]}"  # the pod's own (or a sibling's) port
            if IP.match(host) or host == "localhost":
                return match.group(0)
            return f"{LOOPBACK}:{self.resolve(host, port, what=f'{pod.name} {what}')}"

        return ADDRESS.sub(address, value)

    def _rewrite_env(self, pod: LocalPod, run: ContainerRun, name: str, value: str) -> str:
        if name in LISTEN_PORT_ENV and value.isdigit():
            return str(pod.loopback_port(int(value)))
        return self._rewrite_value(pod, run, value, f"env {name}")

    def _rewrite_args(self, pod: LocalPod, run: ContainerRun, args: list[str]) -> list[str]:
        out: list[str] = []
        previous = ""
        for arg in args:
            flag, eq, value = arg.partition("=")
            if previous.startswith("--") and previous.endswith("port") and int(arg) < 0:
                out.append(arg)  # a port turned off
            elif previous.startswith("--") and previous.endswith("port"):
                out.append(str(pod.loopback_port(int(arg))))  # a listen port
            elif (pod.component, previous) in FORWARDED_PATHS:
                out.append(self._forwarded_path(pod, previous, arg))
            elif flag.startswith("--") and eq and flag.endswith("port"):
                out.append(f"{flag}={pod.loopback_port(int(value))}")
            elif flag.startswith("--") and eq and (pod.component, flag) in FORWARDED_PATHS:
                out.append(f"{flag}={self._forwarded_path(pod, flag, value)}")
            elif flag.startswith("--") and eq:
                out.append(f"{flag}={self._rewrite_value(pod, run, value, flag)}")
            else:
                out.append(self._rewrite_value(pod, run, arg, "an argument"))
            previous = "" if eq else arg
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

    def start(self, init_timeout: float = 300.0) -> None:
        """Start every pod, like Kubernetes does (no ordering between workloads): its init
        containers one after the other to completion, then its container."""
        for pod in self.pods:
            for run in pod.init:
                self._run_init(pod, run, init_timeout)
            self._run(pod)

    def _base_env(self) -> dict[str, str]:
        """The image's PATH: the splitserve scripts first, then the system's."""
        path = os.pathsep.join([str(self.bin_dir), os.environ.get("PATH", "/usr/bin:/bin")])
        return {"PATH": path, "LANG": "C.UTF-8"}

    def _run_init(self, pod: LocalPod, run: ContainerRun, timeout: float) -> None:
        with pod.log_path.open("ab") as log:
            log.write(f"--- init container {run.name} ---\n".encode())
            log.flush()
            result = subprocess.run(
                run.argv,
                env={**self._base_env(), **run.env, **self.init_env},
                cwd=pod.root,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                timeout=timeout,
                check=False,
            )
        if result.returncode != 0:
            raise PodFailed(
                f"{pod.name}: init container {run.name} exited with code {result.returncode}:"
                f"\n{pod.log_tail()}"
            )

    def _run(self, pod: LocalPod) -> None:
        # Its own session, so that a container's child processes (a tpGroup pod's ranks) can be
        # killed with it, as the kubelet kills a container's whole cgroup.
        with pod.log_path.open("ab") as log:
            pod.process = subprocess.Popen(
                pod.argv,
                env={**self._base_env(), **pod.env},
                cwd=pod.root,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def restart(self, pod: LocalPod) -> None:
        """What the kubelet does when a container's liveness fails or it crashes: stop the
        process (SIGTERM, SIGKILL after the grace period) and start the container again, in the
        same pod (same name, ports and emptyDirs)."""
        if pod.process is not None:
            terminate([pod], self._executable)
        self._run(pod)

    def probe(self, pod: LocalPod, kind: str) -> bool:
        """Run the container's own probe once (gRPC or HTTP GET)."""
        return run_probe(pod, kind)

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
        """Stop every pod as the kubelet does (frontends first): its preStop hook, then SIGTERM
        by PID, then SIGKILL once terminationGracePeriodSeconds (counted from the preStop's
        start) have passed."""
        terminate([p for p in reversed(self.pods) if p.process], self._executable)

    def describe(self) -> str:
        return "\n".join(f"{p.name}: {' '.join(p.argv)}" for p in self.pods)

    def pods_of(self, component: str) -> list[LocalPod]:
        return [p for p in self.pods if p.component == component]


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

"""What the kubelet does to a running pod, for local_cluster.py: run its probes (gRPC, or HTTP
GET over HTTP or HTTPS without verifying the certificate) and stop it (the preStop hook, SIGTERM,
SIGKILL once terminationGracePeriodSeconds, counted from the preStop's start, have passed)."""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.helm.chart_render import Doc
from tests.helm.local_pods import LOOPBACK, LocalPod, WiringError

Executable = Callable[[LocalPod, str], str]
"""Where a container's command runs from here: (pod, command name) -> path."""


def run_probe(pod: LocalPod, kind: str) -> bool:
    """Run the container's `kind` probe (startupProbe, ...) once; no probe counts as success."""
    probe = pod.container.get(kind)
    if probe is None:
        return True
    if "httpGet" in probe:
        return _http_probe(pod, probe["httpGet"])
    if "grpc" not in probe:
        raise WiringError(f"{pod.name}: {kind} is neither a gRPC nor an HTTP GET probe")
    target = f"{LOOPBACK}:{pod.loopback_port(int(probe['grpc']['port']))}"
    request = health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", ""))
    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=2.0)
    except grpc.RpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def _http_probe(pod: LocalPod, get: Doc) -> bool:
    """Success is a status in [200, 400); over HTTPS the server's certificate is not verified."""
    scheme = get.get("scheme", "HTTP").lower()
    url = f"{scheme}://{LOOPBACK}:{pod.loopback_port(get['port'])}{get.get('path', '/')}"
    context = None
    if scheme == "https":
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(url, timeout=2.0, context=context) as reply:
            return 200 <= int(reply.status) < 400
    except urllib.error.HTTPError as err:
        return 200 <= err.code < 400
    except (OSError, ValueError):
        return False


def terminate(pods: list[LocalPod], executable: Executable) -> None:
    """Stop the pods' containers together, each as the kubelet would."""
    started = time.monotonic()
    running = [p for p in pods if p.process is not None and p.process.poll() is None]
    hooks = {p.name: _start_pre_stop(p, executable) for p in running}
    deadlines = {
        p.name: started + float(p.spec.get("terminationGracePeriodSeconds", 30)) for p in running
    }
    for pod in running:
        assert pod.process is not None
        hook = hooks[pod.name]
        if hook is not None:
            try:
                hook.wait(timeout=max(0.1, deadlines[pod.name] - time.monotonic()))
            except subprocess.TimeoutExpired:
                hook.kill()
                hook.wait()
        pod.process.send_signal(signal.SIGTERM)
    for pod in running:
        assert pod.process is not None
        try:
            pod.process.wait(timeout=max(0.1, deadlines[pod.name] - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(pod.process.pid, signal.SIGKILL)  # the container's process group
            pod.process.wait()


def _start_pre_stop(pod: LocalPod, executable: Executable) -> subprocess.Popen[bytes] | None:
    hook = pod.container.get("lifecycle", {}).get("preStop")
    if hook is None:
        return None
    if "exec" not in hook:
        raise WiringError(f"{pod.name}: only exec preStop hooks are emulated")
    command = list(hook["exec"]["command"])
    argv = [executable(pod, command[0]), *command[1:]]
    return subprocess.Popen(argv, cwd=pod.root, stdin=subprocess.DEVNULL)

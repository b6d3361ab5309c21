"""A rendered chart launched as local processes (local_cluster.py) for one test module: started,
its pods ready, stopped at the end; and a counter read off a launched pod's metrics port."""

from __future__ import annotations

import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.helm.chart_render import Manifests
from tests.helm.local_cluster import LocalCluster
from tests.helm.local_pods import LocalPod
from tests.helm.worker_caches import seed_worker_pods

BIN_DIR = Path(sys.executable).parent


@contextmanager
def launched(
    manifests: Manifests,
    folder: Path,
    cpu_kernels_dir: Path | None,
    secrets: dict[str, dict[str, str]] | None = None,
) -> Iterator[LocalCluster]:
    local = LocalCluster(manifests, folder, BIN_DIR, secrets=secrets)
    seed_worker_pods(local, cpu_kernels_dir)
    try:
        local.start()
        local.wait_ready(420)
        yield local
    finally:
        local.stop()


def pod_counter(pod: LocalPod, name: str, port: str = "core-metrics") -> float:
    """A counter's value (its samples summed) on a pod's metrics port (default: an engine
    core's)."""
    url = f"http://127.0.0.1:{pod.loopback_port(port)}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        lines = reply.read().decode().splitlines()
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith(name + "{"))

"""Launched worker pods (local_cluster.py) start with this machine's build of the CPU kernels in
their cache volume (tests/fixtures/kernel_cache.py): what the launch tests check is the wiring,
not the first start's compile. A pod whose cache path is wrong still fails (the path must be on
a writable volume) or builds the kernels where it looks for them."""

from __future__ import annotations

from pathlib import Path

from tests.fixtures.kernel_cache import seed_cpu_kernels
from tests.helm.local_cluster import LocalCluster


def seed_worker_pods(cluster: LocalCluster, built: Path | None) -> None:
    """Every worker pod's cache volume (its SPLITSERVE_CACHE_DIR) holds the built kernels (a pod
    without one is left as it is: its workers build them wherever they look)."""
    for pod in cluster.pods_of("worker"):
        if cache_dir := pod.env.get("SPLITSERVE_CACHE_DIR"):
            seed_cpu_kernels(Path(cache_dir), built)

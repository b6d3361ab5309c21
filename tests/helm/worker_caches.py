"""This machine's build of the workers' CPU kernels, copied into the cache volume of launched
worker pods (local_cluster.py) and of `docker run` stacks, so that they load it rather than each
compile it again on first start (about a minute on 2 cores, two pods at once). What these tests
check is the wiring; the build itself is the kernel tests' (tests/unit/worker/test_cpu_kernels.py),
and a pod whose cache path is wrong still fails (the path must be on a writable volume) or
builds the kernels where it looks for them."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.helm.local_cluster import LocalCluster


def built_cpu_kernels() -> Path:
    """The folder of the kernels' build in splitserve's cache on this machine (where the suite's
    other stacks build and load it too), built here on first use."""
    from worker_svc.kernels.cpu_kernels import built_library_folder

    return built_library_folder()


def seed_cpu_kernels(cache_dir: Path, built: Path) -> None:
    """A copy of `built` where a worker whose SPLITSERVE_CACHE_DIR is `cache_dir` looks first."""
    shutil.copytree(built, cache_dir / "kernels" / built.name, dirs_exist_ok=True)


def seed_worker_pods(cluster: LocalCluster, built: Path) -> None:
    """Every worker pod's cache volume (its SPLITSERVE_CACHE_DIR) holds the built kernels."""
    for pod in cluster.pods_of("worker"):
        seed_cpu_kernels(Path(pod.env["SPLITSERVE_CACHE_DIR"]), built)

"""A rendered chart launched as local processes (local_cluster.py) for one test module: started,
its pods ready, stopped at the end."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.helm.chart_render import Manifests
from tests.helm.local_cluster import LocalCluster
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

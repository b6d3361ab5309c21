"""Start, watch and stop the two servers of the side-by-side benchmark.

Each server runs as a subprocess in its own session (process group), its output in a log file
under .bench/peer-logs/; it is stopped by that group's id (SIGTERM, then SIGKILL after a
grace), also when the benchmark fails. Readiness: splitserve's `READY` line (printed by
`splitserve up` once every service answers SERVING on its gRPC health check); vLLM's `/health`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peer_http import http_get_ok

LOOPBACK = "127.0.0.1"
STOP_GRACE_S = 30.0
VLLM_LAUNCHER = Path(__file__).with_name("vllm_launcher.py")
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "4",  # GiB; vLLM's NUMA memory check fails without it
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",  # both cores
    "VLLM_NO_USAGE_STATS": "1",  # no usage reports leave this machine
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
READY_LINE = re.compile(r"^READY frontend=(\S+)", re.MULTILINE)


class ServerError(RuntimeError):
    """A server exited or never became ready; the message ends with its log's tail."""


@dataclass
class ServerProcess:
    """One server under test, from Popen on."""

    name: str
    command: list[str]
    env: dict[str, str]
    """What the command gets on top of this process's environment."""
    log_path: Path
    process: subprocess.Popen[bytes]
    started: float

    @property
    def command_line(self) -> str:
        """The command as a shell line, its extra environment first."""
        return shell_line(self.command, self.env)

    def log_tail(self, num_lines: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-num_lines:])


def start(
    name: str, command: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None
) -> ServerProcess:
    """Start `command` in a new session with stdout and stderr going to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    return ServerProcess(
        name, list(command), dict(env or {}), log_path, process, time.perf_counter()
    )


def shell_line(command: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    assignments = [f"{key}={shlex.quote(value)}" for key, value in (env or {}).items()]
    return " ".join([*assignments, shlex.join(command)])


def wait_ready(server: ServerProcess, is_ready: Callable[[], bool], timeout_s: float) -> float:
    """Poll until `is_ready()`; returns seconds from process start to ready. Raises
    ServerError when the process exits first or the timeout passes."""
    deadline = server.started + timeout_s
    while True:
        if is_ready():
            return time.perf_counter() - server.started
        code = server.process.poll()
        if code is not None:
            raise ServerError(
                f"{server.name} exited with code {code} before it was ready; "
                f"log {server.log_path}:\n{server.log_tail()}"
            )
        if time.perf_counter() > deadline:
            raise ServerError(
                f"{server.name} not ready after {timeout_s:.0f} s; "
                f"log {server.log_path}:\n{server.log_tail()}"
            )
        time.sleep(0.1)


def stop(server: ServerProcess, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the server's process group, SIGKILL it after the grace; reap the leader."""
    pgid = server.process.pid  # the session leader: its pid is the group's id
    _signal_group(pgid, signal.SIGTERM)
    try:
        server.process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        _signal_group(pgid, signal.SIGKILL)
        server.process.wait()
    _signal_group(pgid, signal.SIGKILL)  # children that outlived their leader


def _signal_group(pgid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signum)


def splitserve_ready_addr(server: ServerProcess) -> str | None:
    """The frontend address from `splitserve up`'s READY line, once it is in the log."""
    try:
        match = READY_LINE.search(server.log_path.read_text(errors="replace"))
    except OSError:
        return None
    return match.group(1) if match else None


def splitserve_command(model: str, port: int, flags: Sequence[str]) -> list[str]:
    script = Path(sys.executable).with_name("splitserve")
    launcher = [str(script)] if script.exists() else [sys.executable, "-m", "splitserve.cli"]
    return [*launcher, "up", "--model", model, "--port", str(port), *flags]


def splitserve_has_http(command_prefix: Sequence[str]) -> bool:
    """True when `splitserve up` has the `--http-port` flag (the OpenAI HTTP endpoint)."""
    helptext = subprocess.run(
        [*command_prefix, "up", "--help"], capture_output=True, text=True, check=False
    ).stdout
    return "--http-port" in helptext


def vllm_command(vllm_python: str, model: str, port: int, flags: Sequence[str]) -> list[str]:
    """`vllm serve` through the launcher, in the vLLM venv's interpreter."""
    return [
        vllm_python,
        "-P",
        str(VLLM_LAUNCHER),
        "serve",
        model,
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        *flags,
    ]


def vllm_is_ready(port: int) -> Callable[[], bool]:
    return lambda: http_get_ok(f"http://{LOOPBACK}:{port}/health", timeout=1.0)

"""Where `splitserve serve` (or `up`) tells the client commands its address.

Once READY, the launcher writes `last-serve.json` into splitserve's cache folder
(`$SPLITSERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/splitserve`, else `~/.cache/splitserve`): the
frontend's gRPC and HTTP addresses and the launcher's pid. It removes the file when it stops.
`splitserve generate` and `splitserve bench serve` without `--addr` (or `SPLITSERVE_ADDR`) connect
to the recorded frontend while the launcher that wrote it still runs, else to 127.0.0.1:50051.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

from splitserve_runtime.model_cache import default_cache_dir

STATE_FILENAME = "last-serve.json"
DEFAULT_ADDR = "127.0.0.1:50051"
"""The frontend's default gRPC address (`splitserve frontend --port`)."""
ADDR_HELP = (
    "frontend HOST:PORT (default: the address `splitserve serve` or `up` printed, while it "
    f"runs; else {DEFAULT_ADDR})"
)


def state_path(environ: Mapping[str, str] | None = None) -> Path:
    return default_cache_dir(environ) / STATE_FILENAME


def connectable(address: str) -> str:
    """`0.0.0.0:P` (listening everywhere) -> `127.0.0.1:P`, the address to call it on."""
    host, _, port = address.rpartition(":")
    return f"127.0.0.1:{port}" if host in ("0.0.0.0", "", "[::]") else address


def record_serve(frontend: str, http: str, environ: Mapping[str, str] | None = None) -> Path:
    """Write this launcher's addresses (atomically: readers never see half a file)."""
    path = state_path(environ)
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {"frontend": connectable(frontend), "http": http and connectable(http)}
    scratch = path.with_name(f".{STATE_FILENAME}.{os.getpid()}")
    scratch.write_text(json.dumps({**entry, "pid": os.getpid()}) + "\n")
    scratch.replace(path)
    return path


def forget_serve(environ: Mapping[str, str] | None = None) -> None:
    """Remove the file if this process wrote it (a later launcher's entry stays)."""
    path = state_path(environ)
    if _read(path).get("pid") == os.getpid():
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


def default_address(environ: Mapping[str, str] | None = None) -> str:
    """The recorded frontend while its launcher runs, else DEFAULT_ADDR."""
    entry = _read(state_path(environ))
    pid, frontend = entry.get("pid"), entry.get("frontend")
    if isinstance(pid, int) and isinstance(frontend, str) and _is_running(pid):
        return frontend
    return DEFAULT_ADDR


def _read(path: Path) -> dict[str, object]:
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return entry if isinstance(entry, dict) else {}


def _is_running(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True

"""A real stack over mutual TLS: a second core with another identity cannot take the workers; a
restarted core (same identity, a later epoch) takes them over and the frontend serves again;
what clients see meanwhile names no internal address."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from splitserve.local_pki import LocalPki
from splitserve.loopback_ports import free_ports
from splitserve_runtime.tls import CORE_ROLE
from tests.e2e.client import generate, text_request
from tests.e2e.stack import KV_BYTES, Stack
from tests.security.peers import issue

pytestmark = pytest.mark.slow


def _generate_error(frontend: str) -> grpc.RpcError | None:
    try:
        generate(frontend, text_request("hello", max_tokens=2), timeout=30)
    except grpc.RpcError as err:
        return err
    return None


def test_a_restarted_core_takes_over_and_a_stranger_cannot(
    tiny_model_dir: Path, pki: LocalPki, tmp_path: Path
) -> None:
    stack = Stack(tiny_model_dir, pki=pki).start()
    try:
        frontend, worker = stack.frontend, stack.worker
        assert _generate_error(frontend) is None
        stranger = issue(pki.ca, tmp_path, "stranger", [CORE_ROLE, "splitserve-core-b"])
        port, dist = free_ports(2)
        second = subprocess.run(
            [sys.executable, "-m", "core_svc", "--model", str(tiny_model_dir)]
            + ["--port", str(port), "--metrics-port", "-1", "--worker-addrs", worker]
            + ["--distributed-init-method", f"tcp://127.0.0.1:{dist}"]
            + ["--kv-cache-memory-bytes", KV_BYTES, "--worker-connect-timeout", "60"]
            + ["--tls-cert-file", stranger.cert_file, "--tls-key-file", stranger.key_file]
            + ["--tls-ca-file", stranger.ca_file],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 1 and "PERMISSION_DENIED" in second.stderr, second.stderr
        assert _generate_error(frontend) is None  # the owner's engine never noticed

        core = stack.child("core")
        argv = list(core.process.args)  # type: ignore[arg-type]
        core.process.kill()
        core.process.wait()
        deadline = time.monotonic() + 30
        while (err := _generate_error(frontend)) is None:
            assert time.monotonic() < deadline, "requests kept succeeding without a core"
            time.sleep(0.2)
        details = err.details() or ""
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert "error id" in details and core.address not in details and "127.0.0.1" not in details

        core.process = subprocess.Popen(argv)  # same certificate, a later epoch
        deadline = time.monotonic() + 120
        while _generate_error(frontend) is not None:
            assert core.process.poll() is None, "the restarted core exited"
            assert time.monotonic() < deadline, "the restarted core never served"
            time.sleep(0.5)
    finally:
        stack.stop()

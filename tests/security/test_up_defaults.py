"""`splitserve up` is secure by default: its internal hops are mutual TLS with a throwaway CA
(private folder, keys 0600, deleted on exit), and `--api-key` guards the public API while
health and reflection stay open."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc
from splitserve_runtime.tls import CORE_ROLE, FRONTEND_ROLE, WORKER_ROLE
from tests.e2e.client import join, text_request
from tests.e2e.stack import UP_ANY_METRICS_PORTS
from tests.security.peers import health_status, rpc_error, speaks_http2

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
KEY = "s3cret-key"
READINESS = "splitserve.frontend.v1.GenerationService"


def _generate(addr: str, authorization: str | None) -> int:
    metadata = (("authorization", authorization),) if authorization is not None else None
    with grpc.insecure_channel(addr) as ch:
        stub = gen_grpc.GenerationServiceStub(ch)
        responses = stub.Generate(text_request("hi", max_tokens=2), timeout=60, metadata=metadata)
        return len(join(responses)[0].token_ids)


def _check_api_key(frontend: str) -> None:
    for authorization in (None, "Bearer wrong", f"Basic {KEY}", KEY):
        err = rpc_error(lambda a=authorization: _generate(frontend, a))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, authorization
        assert KEY not in (err.details() or "")
    assert _generate(frontend, f"Bearer {KEY}") == 2
    assert _generate(frontend, f"bearer {KEY}") == 2
    with grpc.insecure_channel(frontend) as ch:
        stub = gen_grpc.GenerationServiceStub(ch)
        err = rpc_error(lambda: stub.GetModelInfo(gen_pb2.GetModelInfoRequest(), timeout=10))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    # Health stays open (probes carry no key), and so does reflection.
    assert health_status(frontend, None, FRONTEND_ROLE, READINESS) == 1
    grpcurl = BIN / "grpcurl"
    if grpcurl.exists():
        listed = subprocess.run(
            [str(grpcurl), "-plaintext", frontend, "list"], capture_output=True, text=True
        )
        assert READINESS in listed.stdout, listed.stderr


def _private_pki(tmp: Path) -> Path:
    (folder,) = [p for p in tmp.iterdir() if p.name.startswith("splitserve-pki-")]
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    keys = sorted(folder.glob("*.key"))
    assert len(keys) == 4 and all(stat.S_IMODE(k.stat().st_mode) == 0o600 for k in keys)
    return folder


def test_up_serves_over_mutual_tls_with_an_api_key(tiny_model_dir: Path, tmp_path: Path) -> None:
    env = dict(os.environ, SPLITSERVE_LOG_LEVEL="warning", TMPDIR=str(tmp_path))
    env.pop("SPLITSERVE_API_KEY", None)
    up = subprocess.Popen(
        [str(BIN / "splitserve"), "up", "--model", str(tiny_model_dir), "--grpc-port", "0"]
        + UP_ANY_METRICS_PORTS
        + ["--kv-cache-memory-bytes", "16777216", "--api-key", KEY, "--http-port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        assert up.stdout is not None
        line = up.stdout.readline()
        match = re.fullmatch(
            r"READY frontend=(\S+) core=(\S+) workers=(\S+) metrics=\S+ http=\S+\n", line
        )
        assert match, line
        frontend, core, worker = match.groups()
        assert speaks_http2(frontend)  # the public port is plaintext here
        for addr, role in ((core, CORE_ROLE), (worker, WORKER_ROLE)):  # no plaintext inside
            err = rpc_error(lambda a=addr, r=role: health_status(a, None, r))
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert not speaks_http2(addr), role  # listening, refusing plaintext
        _check_api_key(frontend)
        folder = _private_pki(tmp_path)
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
        assert not folder.exists()  # the throwaway CA is gone with the stack
    finally:
        if up.poll() is None:  # a failed check: SIGTERM, so the launcher stops its children
            up.send_signal(signal.SIGTERM)
            try:
                up.wait(timeout=60)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait()

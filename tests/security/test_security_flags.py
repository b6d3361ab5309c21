"""The security flags: safe defaults, all-or-none certificate flags, vLLM's API-key variables,
the plaintext warning, and the plaintext health-only port beside a mutual-TLS port."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

import grpc
import pytest

from core_svc.config import parse_config as parse_core
from frontend_svc.config import parse_config as parse_frontend
from splitserve.local_pki import LocalPki
from splitserve.loopback_ports import free_ports
from splitserve_runtime.listener import Listener, bind, internal_listener
from splitserve_runtime.sync_service_host import SyncServiceHost
from splitserve_runtime.tls import CORE_ROLE, WORKER_ROLE
from tests.security.peers import health_status, rpc_error
from worker_svc.config import parse_config as parse_worker

CORE_ARGS = ["--worker-addrs", "127.0.0.1:1"]
SERVICE = "splitserve.worker.v1.WorkerService"


def test_internal_services_are_closed_by_default_and_the_frontend_is_public() -> None:
    core, worker, frontend = parse_core(CORE_ARGS, {}), parse_worker([], {}), parse_frontend([], {})
    assert (core.host, worker.host) == ("127.0.0.1", "127.0.0.1")
    assert not core.enable_reflection and not worker.enable_reflection
    assert frontend.enable_reflection and frontend.host == "0.0.0.0"
    assert frontend.max_receive_message_bytes == 4 * 1024 * 1024
    assert core.tls is worker.tls is frontend.tls is frontend.ssl is None
    assert parse_worker(["--enable-reflection"], {}).enable_reflection
    assert parse_core(CORE_ARGS, {"SPLITSERVE_HEALTH_PORT": "8081"}).health_port == 8081


def test_one_message_limit_bounds_grpc_messages_and_http_bodies() -> None:
    frontend = parse_frontend(["--max-receive-message-bytes", "1000"], {})
    assert frontend.max_receive_message_bytes == frontend.http_limits.max_body_bytes == 1000
    assert parse_frontend([], {}).http_limits.max_body_bytes == 4 * 1024 * 1024


def test_certificate_flags_come_all_together_and_readable(pki: LocalPki) -> None:
    files = pki.files[CORE_ROLE]
    full = ["--tls-cert-file", files.cert_file, "--tls-key-file", files.key_file]
    full += ["--tls-ca-file", files.ca_file]
    assert parse_core(CORE_ARGS + full, {}).tls is not None
    assert parse_worker(full, {}).tls is not None
    for parse, base in ((parse_core, CORE_ARGS), (parse_worker, []), (parse_frontend, [])):
        with pytest.raises(SystemExit):
            parse(base + full[:4], {})  # no CA
        with pytest.raises(SystemExit):
            parse(base + ["--tls-cert-file", "/nonexistent.pem"] + full[2:], {})
    with pytest.raises(SystemExit):
        parse_frontend(["--ssl-ca-certs", files.ca_file], {})  # a CA without a certificate
    public = parse_frontend(
        ["--ssl-certfile", files.cert_file, "--ssl-keyfile", files.key_file], {}
    )
    assert public.ssl is not None and public.ssl.ca_file == ""


def test_api_key_from_flag_or_environment_like_vllm() -> None:
    assert parse_frontend([], {"VLLM_API_KEY": "v"}).api_key == "v"
    both = {"VLLM_API_KEY": "v", "SPLITSERVE_API_KEY": "s"}
    assert parse_frontend([], both).api_key == "s"
    config = parse_frontend(["--api-key", "flag-key-7"], both)
    assert config.api_key == "flag-key-7" and "flag-key-7" not in repr(config)


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def add_insecure_port(self, address: str) -> int:
        self.calls.append(address)
        return 1

    def add_secure_port(self, address: str, creds: Any) -> int:
        raise AssertionError("plaintext expected")


@pytest.mark.parametrize(
    ("host", "warns"),
    [
        ("0.0.0.0", True),
        ("10.0.0.7", True),
        ("127.0.0.1", False),
        ("::1", False),
        ("localhost", False),
    ],
)
def test_plaintext_on_a_reachable_address_warns(
    host: str, warns: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    assert bind(_Recorder(), "core", host, 5, Listener()) == 1
    assert any("PLAINTEXT" in r.getMessage() for r in caplog.records) == warns


def test_a_plaintext_health_port_beside_a_mutual_tls_port(pki: LocalPki) -> None:
    port, health_port = free_ports(2)
    host = SyncServiceHost(
        name="worker",
        host="127.0.0.1",
        port=port,
        service_names=[SERVICE],
        listener=internal_listener(
            tls=pki.files[WORKER_ROLE],
            allowed_roles={SERVICE: frozenset({CORE_ROLE})},
            enable_reflection=False,
            health_port=health_port,
        ),
    )
    host.start()
    host.set_ready(True)
    try:
        assert health_status(f"127.0.0.1:{health_port}", None, WORKER_ROLE, SERVICE) == 1
        main = f"127.0.0.1:{port}"
        assert rpc_error(lambda: health_status(main, None, WORKER_ROLE)).code() == (
            grpc.StatusCode.UNAVAILABLE
        )
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as ch:  # health only
            err = rpc_error(lambda: ch.unary_unary(f"/{SERVICE}/Describe")(b"", timeout=5))
        assert err.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        host.server.stop(None)
        if host._health_server is not None:
            host._health_server.stop(None)


def test_certificate_files_must_be_pem(tmp_path: Path) -> None:
    bogus = tmp_path / "cert.pem"
    bogus.write_text("not a certificate")
    args = ["--tls-cert-file", str(bogus), "--tls-key-file", str(bogus)]
    with pytest.raises(SystemExit):
        parse_worker(args + ["--tls-ca-file", str(bogus)], {})


def test_the_container_health_check_uses_the_plaintext_health_port() -> None:
    spec = importlib.util.spec_from_file_location(
        "splitserve_healthcheck", Path(__file__).parents[2] / "docker" / "healthcheck.py"
    )
    assert spec is not None and spec.loader is not None
    hc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hc)
    argv = ["splitserve", "core", "--port", "6000", "--tls-cert-file", "c.pem"]
    assert hc.port_of([*argv, "--health-port", "8081"], {}, "core") == 8081
    assert hc.port_of(argv, {"SPLITSERVE_HEALTH_PORT": "8082"}, "core") == 8082
    assert hc.port_of(argv, {"SPLITSERVE_HEALTH_PORT": "-1"}, "core") == 6000

"""Mutual TLS on the internal hops of a real stack (worker, core and frontend processes): who
can connect, which role may call which service, and what malformed or oversized messages get."""

from __future__ import annotations

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2

from splitserve.local_pki import LAUNCHER_IDENTITY, LocalPki
from splitserve_contracts.core.v1 import core_service_pb2 as core_pb2
from splitserve_contracts.core.v1 import core_service_pb2_grpc as core_grpc
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc
from splitserve_contracts.worker.v1 import worker_service_pb2 as worker_pb2
from splitserve_contracts.worker.v1 import worker_service_pb2_grpc as worker_grpc
from splitserve_runtime.tls import CORE_ROLE, FRONTEND_ROLE, WORKER_ROLE, TlsFiles
from tests.e2e.client import generate, text_request
from tests.e2e.stack import Stack
from tests.security.peers import (
    channel,
    health_status,
    raw_stream,
    raw_unary,
    raw_unary_stream,
    rpc_error,
    speaks_http2,
    tls_context,
)

pytestmark = pytest.mark.slow
SERVING = 1
MALFORMED = b"\x0a\x05ab"  # field 1, 5 bytes announced, 2 sent
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


def test_plaintext_peers_are_refused_on_internal_ports(secure_stack: Stack, pki: LocalPki) -> None:
    """Refused at the transport by a port that listens (UNAVAILABLE alone is also what a
    closed port gives): a plaintext HTTP/2 preface gets no answer, the same preface over TLS
    with the deployment's certificate does; a plaintext port (the frontend's) answers it."""
    assert speaks_http2(secure_stack.frontend)
    probe = tls_context(pki.files[LAUNCHER_IDENTITY])
    for addr, role in ((secure_stack.core, CORE_ROLE), (secure_stack.worker, WORKER_ROLE)):
        err = rpc_error(lambda a=addr, r=role: health_status(a, None, r))
        assert err.code() == grpc.StatusCode.UNAVAILABLE, role
        assert not speaks_http2(addr), role
        assert speaks_http2(addr, probe, role), role


def test_peers_of_another_ca_are_refused(
    secure_stack: Stack, pki: LocalPki, foreign: dict[str, TlsFiles]
) -> None:
    ca = pki.files[FRONTEND_ROLE].ca_file  # the client trusts the servers; they do not trust it
    for addr, caller, role in (
        (secure_stack.core, FRONTEND_ROLE, CORE_ROLE),
        (secure_stack.worker, CORE_ROLE, WORKER_ROLE),
    ):
        files = TlsFiles(foreign[caller].cert_file, foreign[caller].key_file, ca)
        err = rpc_error(lambda a=addr, f=files, r=role: health_status(a, f, r))
        assert err.code() == grpc.StatusCode.UNAVAILABLE, role
        assert not speaks_http2(addr, tls_context(files), role), role  # the handshake fails
        assert speaks_http2(addr, tls_context(pki.files[caller]), role), role  # this CA's: on


def test_each_service_admits_only_the_roles_that_may_call_it(
    secure_stack: Stack, pki: LocalPki
) -> None:
    core, worker = secure_stack.core, secure_stack.worker
    with channel(worker, pki.files[FRONTEND_ROLE], WORKER_ROLE) as ch:
        stub = worker_grpc.WorkerServiceStub(ch)
        err = rpc_error(lambda: stub.Describe(worker_pb2.DescribeRequest(), timeout=10))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "splitserve-core" in (err.details() or "")
    for caller in (WORKER_ROLE, CORE_ROLE):
        with channel(core, pki.files[caller], CORE_ROLE) as ch:
            stub = core_grpc.EngineCoreServiceStub(ch)
            err = rpc_error(lambda s=stub: s.Handshake(core_pb2.HandshakeRequest(), timeout=10))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED, caller
    with channel(core, pki.files[FRONTEND_ROLE], CORE_ROLE) as ch:
        info = core_grpc.EngineCoreServiceStub(ch).Handshake(
            core_pb2.HandshakeRequest(), timeout=10
        )
    assert info.engine_info.vocab_size > 0
    # Health answers any peer of the deployment's CA (the launcher's probe certificate).
    probe = pki.files[LAUNCHER_IDENTITY]
    assert health_status(core, probe, CORE_ROLE) == SERVING
    assert health_status(worker, probe, WORKER_ROLE) == SERVING


def test_clients_check_the_role_of_the_server(secure_stack: Stack, pki: LocalPki) -> None:
    """A frontend pointed at a worker's port (expecting the core) refuses to talk to it."""
    worker = secure_stack.worker
    err = rpc_error(lambda: health_status(worker, pki.files[FRONTEND_ROLE], CORE_ROLE))
    assert err.code() == grpc.StatusCode.UNAVAILABLE


def test_reflection_is_off_on_internal_services_and_on_for_the_frontend(
    secure_stack: Stack, pki: LocalPki
) -> None:
    request = reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
    probe = pki.files[LAUNCHER_IDENTITY]
    for addr, role in ((secure_stack.core, CORE_ROLE), (secure_stack.worker, WORKER_ROLE)):
        with channel(addr, probe, role) as ch:
            err = rpc_error(lambda c=ch: raw_stream(c, REFLECTION, [request]))
        assert err.code() == grpc.StatusCode.UNIMPLEMENTED, role
    with channel(secure_stack.frontend, None, FRONTEND_ROLE) as ch:
        replies = raw_stream(ch, REFLECTION, [request])
    listed = reflection_pb2.ServerReflectionResponse.FromString(replies[0])
    names = [s.name for s in listed.list_services_response.service]
    assert "splitserve.frontend.v1.GenerationService" in names


def _assert_invalid_argument(err: grpc.RpcError, type_name: str) -> None:
    details = err.details() or ""
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, details
    assert type_name in details and "malformed" in details
    assert "DecodeError" not in details and "<class" not in details


def test_malformed_messages_get_invalid_argument_on_every_service(
    secure_stack: Stack, pki: LocalPki
) -> None:
    frontend = secure_stack.frontend
    with channel(frontend, None, FRONTEND_ROLE) as ch:
        method = "/splitserve.frontend.v1.GenerationService/"
        err = rpc_error(lambda: raw_unary(ch, method + "GetModelInfo", MALFORMED))
        _assert_invalid_argument(err, "GetModelInfoRequest")
        err = rpc_error(lambda: raw_unary_stream(ch, method + "Generate", MALFORMED))
        _assert_invalid_argument(err, "GenerateRequest")
    with channel(secure_stack.core, pki.files[FRONTEND_ROLE], CORE_ROLE) as ch:
        method = "/splitserve.core.v1.EngineCoreService/EngineStream"
        err = rpc_error(lambda: raw_stream(ch, method, [MALFORMED]))
        _assert_invalid_argument(err, "EngineStreamRequest")
    with channel(secure_stack.worker, pki.files[CORE_ROLE], WORKER_ROLE) as ch:
        method = "/splitserve.worker.v1.WorkerService/LoadModel"
        err = rpc_error(lambda: raw_unary(ch, method, MALFORMED))
        _assert_invalid_argument(err, "LoadModelRequest")
    assert generate(frontend, text_request("still serving", max_tokens=2))[0].finish_reason


def test_model_info_discloses_no_path(secure_stack: Stack) -> None:
    with grpc.insecure_channel(secure_stack.frontend) as ch:
        info = gen_grpc.GenerationServiceStub(ch).GetModelInfo(
            gen_pb2.GetModelInfoRequest(), timeout=10
        )
    assert info.served_model_name and info.model_path == ""
    assert "/" not in str(info)


def test_requests_over_the_public_size_limit_are_refused(secure_stack: Stack) -> None:
    frontend = secure_stack.frontend
    huge = text_request("word " * (1024 * 1024), max_tokens=1)  # 5 MiB > the 4 MiB default
    err = rpc_error(lambda: generate(frontend, huge))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert generate(frontend, text_request("small", max_tokens=2))[0].finish_reason

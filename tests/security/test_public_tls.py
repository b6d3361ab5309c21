"""TLS on the public port (issue 11, item 3: --ssl-certfile/--ssl-keyfile, vLLM's names), over
real processes: a client that only trusts the CA streams a completion, a plaintext client is
refused during the handshake, and the API key still applies inside TLS."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from splitserve.local_pki import LAUNCHER_IDENTITY, LocalPki
from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc
from splitserve_runtime.channels import ChannelSecurity
from splitserve_runtime.tls import FRONTEND_ROLE
from tests.e2e.client import join, text_request
from tests.e2e.stack import Stack
from tests.security.peers import rpc_error

pytestmark = pytest.mark.slow
KEY = "public-tls-key"


def test_the_public_port_serves_tls_and_refuses_plaintext(tiny_model_dir: Path) -> None:
    with LocalPki() as pki:
        server = pki.files[FRONTEND_ROLE]  # any certificate the client's CA vouches for
        flags = ["--ssl-certfile", server.cert_file, "--ssl-keyfile", server.key_file]
        # Readiness is probed over TLS too (the probe presents a certificate; none is asked).
        probe = ChannelSecurity(pki.files[LAUNCHER_IDENTITY], FRONTEND_ROLE)
        stack = Stack(tiny_model_dir, frontend_flags=flags, api_key=KEY, frontend_probe=probe)
        stack.start()
        try:
            request = text_request("over tls", max_tokens=3)
            trust = grpc.ssl_channel_credentials(Path(server.ca_file).read_bytes())
            name = (("grpc.ssl_target_name_override", FRONTEND_ROLE),)
            with grpc.secure_channel(stack.frontend, trust, options=name) as channel:
                stub = gen_grpc.GenerationServiceStub(channel)
                auth = (("authorization", f"Bearer {KEY}"),)
                completion = join(stub.Generate(request, timeout=60, metadata=auth))[0]
                assert len(completion.token_ids) == 3
                denied = rpc_error(lambda: list(stub.Generate(request, timeout=60)))
                assert denied.code() == grpc.StatusCode.UNAUTHENTICATED
            with grpc.insecure_channel(stack.frontend) as plaintext:
                stub = gen_grpc.GenerationServiceStub(plaintext)
                refused = rpc_error(lambda: list(stub.Generate(request, timeout=10)))
                assert refused.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            stack.stop()

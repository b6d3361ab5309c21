"""A client of a launched chart's frontend Service, as a user outside the cluster would be one:
gRPC and the OpenAI HTTP port (server-sent events), in plaintext or over TLS (trusting the CA of
the frontend's public certificate), with or without the API key."""

from __future__ import annotations

import dataclasses
import json
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import grpc

from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc


@dataclass(frozen=True)
class FrontendClient:
    """The frontend Service's ports as mapped to loopback."""

    grpc_address: str  # 127.0.0.1:PORT
    http_address: str = ""  # 127.0.0.1:PORT ("" = no HTTP port)
    api_key: str = ""
    public_ca: str = ""  # PEM of the CA that signed the frontend's certificate ("" = plaintext)
    server_name: str = "localhost"  # the name in that certificate

    @property
    def metadata(self) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.api_key}")] if self.api_key else []

    def without_key(self) -> FrontendClient:
        return dataclasses.replace(self, api_key="")

    def channel(self) -> grpc.Channel:
        if not self.public_ca:
            return grpc.insecure_channel(self.grpc_address)
        credentials = grpc.ssl_channel_credentials(root_certificates=self.public_ca.encode())
        options = [("grpc.ssl_target_name_override", self.server_name)]
        return grpc.secure_channel(self.grpc_address, credentials, options=options)

    def stub(self, channel: grpc.Channel) -> gen_grpc.GenerationServiceStub:
        return gen_grpc.GenerationServiceStub(channel)

    @property
    def http_base(self) -> str:
        if not self.public_ca:
            return f"http://{self.http_address}"
        return f"https://{self.server_name}:{self.http_address.rsplit(':', 1)[1]}"

    def ssl_context(self) -> ssl.SSLContext | None:
        return ssl.create_default_context(cadata=self.public_ca) if self.public_ca else None


def generate(
    client: FrontendClient, prompt: str, max_tokens: int
) -> list[gen_pb2.GenerateResponse]:
    """A greedy Generate of exactly `max_tokens` tokens, all its responses."""
    params = types_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request = gen_pb2.GenerateRequest(prompt=prompt, sampling_params=params)
    with client.channel() as channel:
        call = client.stub(channel).Generate(request, timeout=180, metadata=client.metadata)
        return list(call)


def sse_completion(
    client: FrontendClient, model: str, prompt: str, max_tokens: int
) -> tuple[int, list[Any]]:
    """POST /v1/completions with stream: (HTTP status, the data events; [DONE] as a string)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Content-Type": "application/json"}
    if client.api_key:
        headers["Authorization"] = f"Bearer {client.api_key}"
    request = urllib.request.Request(
        f"{client.http_base}/v1/completions", json.dumps(body).encode(), headers, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=180, context=client.ssl_context()) as reply:
            lines = [line.decode().strip() for line in reply]
            status = int(reply.status)
    except urllib.error.HTTPError as err:
        return err.code, []
    events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    return status, [e if e == "[DONE]" else json.loads(e) for e in events]

"""Blocking helpers over the public gRPC API for end-to-end tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import grpc

from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc


@dataclass
class Completion:
    """All pieces of one completion index, joined."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: int = 0
    stop_str: str | None = None
    stop_token_id: int | None = None
    num_messages: int = 0
    usage: Any = None


def generate(
    addr: str, request: gen_pb2.GenerateRequest, timeout: float = 120.0
) -> dict[int, Completion]:
    with grpc.insecure_channel(addr) as channel:
        stub = gen_grpc.GenerationServiceStub(channel)
        return join(stub.Generate(request, timeout=timeout))


def join(responses: Any) -> dict[int, Completion]:
    out: dict[int, Completion] = {}
    for r in responses:
        c = out.setdefault(r.index, Completion())
        c.token_ids += list(r.token_ids)
        c.text += r.text
        c.num_messages += 1
        c.usage = r.usage
        if r.finish_reason:
            c.finish_reason = r.finish_reason
            kind = r.WhichOneof("stop_reason")
            c.stop_str = r.stop_str if kind == "stop_str" else None
            c.stop_token_id = r.stop_token_id if kind == "stop_token_id" else None
    return out


def text_request(prompt: str, **params: Any) -> gen_pb2.GenerateRequest:
    return gen_pb2.GenerateRequest(
        prompt=prompt, sampling_params=types_pb2.SamplingParams(**params)
    )

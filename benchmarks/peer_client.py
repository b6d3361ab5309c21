"""One client for both systems: the per-request timing is shared, the wire is a small
pluggable `Transport` (splitserve's public gRPC today, OpenAI `/v1/completions` SSE for vLLM
and, once splitserve serves it, for splitserve too).

Every request is greedy (temperature 0), ignore_eos, min_tokens = max_tokens, prompt given as
token ids; a request that does not stream back exactly max_tokens tokens counts as failed.
Timings are on this client's clock: TTFT = first token received - request sent; the gaps
between tokens are the ITLs (a message holding k tokens counts as k - 1 zero gaps plus the gap
to it, as `splitserve bench serve` and `vllm bench serve` count them).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from benchmarks.peer_http import DONE, completion_chunk_tokens, post_sse
from benchmarks.peer_workloads import RequestSpec, Workload
from splitserve_client.bench_serve import RequestResult
from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc


class Transport(Protocol):
    """Sends one request and streams back the number of new tokens in each message."""

    def stream(self, request: RequestSpec) -> AsyncIterator[int]: ...

    async def aclose(self) -> None: ...


class GrpcTransport:
    """splitserve's public GenerationService/Generate (prompt_token_ids)."""

    def __init__(self, addr: str) -> None:
        self._channel = grpc.aio.insecure_channel(addr)
        self._stub = gen_grpc.GenerationServiceStub(self._channel)

    async def stream(self, request: RequestSpec) -> AsyncIterator[int]:
        params = types_pb2.SamplingParams(
            max_tokens=request.max_tokens,
            min_tokens=request.max_tokens,
            ignore_eos=True,
            temperature=0.0,
        )
        message = gen_pb2.GenerateRequest(
            prompt_token_ids=gen_pb2.TokenIds(ids=request.prompt_token_ids),
            sampling_params=params,
        )
        async for response in self._stub.Generate(message):
            yield len(response.token_ids)

    async def aclose(self) -> None:
        await self._channel.close()


class UsageMismatch(RuntimeError):
    """The server's usage chunk disagrees with the tokens it streamed."""


@dataclass
class OpenAIHttpTransport:
    """OpenAI `/v1/completions` with `stream: true` (vLLM's, and splitserve's once it has one)."""

    host: str
    port: int
    model: str

    def body(self, request: RequestSpec) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": list(request.prompt_token_ids),
            "max_tokens": request.max_tokens,
            "min_tokens": request.max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }

    async def stream(self, request: RequestSpec) -> AsyncIterator[int]:
        num_streamed = 0
        async for data in post_sse(self.host, self.port, "/v1/completions", self.body(request)):
            if data == DONE:
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"server error in stream: {chunk['error']}")
            num_new = completion_chunk_tokens(chunk)
            if num_new:
                num_streamed += num_new
                yield num_new
            usage = chunk.get("usage")
            if usage and usage.get("completion_tokens") != num_streamed:
                raise UsageMismatch(f"streamed {num_streamed} tokens, usage says {usage}")

    async def aclose(self) -> None:
        return None


async def timed_request(transport: Transport, request: RequestSpec) -> RequestResult:
    """Send one request and record when each token arrived; errors are kept, not raised."""
    result = RequestResult(sent=time.perf_counter())
    try:
        async for num_new in transport.stream(request):
            now = time.perf_counter()
            result.token_times.extend([now] * num_new)
            result.num_tokens += num_new
        if result.num_tokens != request.max_tokens:
            result.error = f"got {result.num_tokens} of {request.max_tokens} tokens"
    except Exception as exc:  # reported per request, the workload goes on
        result.error = repr(exc)
    return result


async def _send_at(transport: Transport, request: RequestSpec, start: float) -> RequestResult:
    delay = start + request.arrival_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    return await timed_request(transport, request)


async def run_workload(
    transport: Transport, workload: Workload
) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival time; returns the results (in request order) and the
    wall time from the first send to the last token."""
    start = time.perf_counter()
    results = await asyncio.gather(*(_send_at(transport, r, start) for r in workload.requests))
    return list(results), time.perf_counter() - start

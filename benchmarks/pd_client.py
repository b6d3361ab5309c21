"""The prefill/decode benchmark's client: each request of benchmarks/pd_workload.py streamed over
the gateway's `/v1/completions` at its arrival time, with when each token arrived and the text.

TTFT = the first chunk with text - the request sent, on this client's clock; a request that
does not end with `max_tokens` tokens (the usage chunk's count) is failed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from benchmarks.pd_workload import PdRequest
from benchmarks.peer_http import post_sse_json
from splitserve_client.bench_serve import RequestResult


@dataclass
class PdResult:
    """One request's timings and text."""

    request: PdRequest
    timing: RequestResult
    text: list[str] = field(default_factory=list)


async def _stream(host: str, port: int, model: str, request: PdRequest) -> PdResult:
    body = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = PdResult(request, RequestResult(sent=time.perf_counter()))
    timing = result.timing
    try:
        async for chunk in post_sse_json(host, port, "/v1/completions", body):
            for choice in chunk.get("choices") or []:
                if choice.get("text"):
                    result.text.append(choice["text"])
                    timing.token_times.append(time.perf_counter())
            if chunk.get("usage"):
                timing.num_tokens = int(chunk["usage"]["completion_tokens"])
        if timing.num_tokens != request.max_tokens:
            timing.error = f"got {timing.num_tokens} of {request.max_tokens} tokens"
    except Exception as exc:  # reported per request, the run goes on
        timing.error = repr(exc)
    return result


async def _send_at(host: str, port: int, model: str, request: PdRequest, start: float) -> PdResult:
    delay = start + request.arrival_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    return await _stream(host, port, model, request)


async def run_requests(
    http: str, model: str, requests: Sequence[PdRequest]
) -> tuple[list[PdResult], float]:
    """Every request at its arrival time; the results in workload order and the wall time."""
    host, port = http.rsplit(":", 1)
    start = time.perf_counter()
    results = await asyncio.gather(*(_send_at(host, int(port), model, r, start) for r in requests))
    return list(results), time.perf_counter() - start

"""`splitserve bench serve`: load a running frontend the way `vllm bench serve` does.

N requests with random prompt token ids, sent all at once (`--request-rate inf`) or as a
Poisson process; reports request throughput, output tokens/s and TTFT / TPOT / ITL (mean, p50,
p99). TTFT = first token received - request sent; TPOT = (last - first token) / (tokens - 1);
ITL = gaps between consecutive tokens (a message holding k tokens counts as k - 1 zero gaps plus
the gap to it), all measured on this client's clock.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from splitserve_client.last_serve import ADDR_HELP, default_address
from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc
from splitserve_runtime.flags import FlagParser, non_negative_int, positive_int


@dataclass(frozen=True)
class Workload:
    """What to send."""

    num_prompts: int
    input_len: int
    output_len: int
    request_rate: float = float("inf")
    ignore_eos: bool = True
    temperature: float = 0.0
    vocab_size: int = 0
    seed: int = 0


@dataclass
class RequestResult:
    """Client-side timings of one request."""

    sent: float
    token_times: list[float] = field(default_factory=list)
    num_tokens: int = 0
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def tpot(self) -> float | None:
        if self.num_tokens < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.num_tokens - 1)


GenerateFn = Callable[[list[int], Workload], AsyncIterator[int]]
"""Streams the number of new tokens in each message for one request."""


def random_prompts(workload: Workload) -> list[list[int]]:
    rng = random.Random(workload.seed)
    low = 3  # skip the special tokens at the start of the vocabulary
    return [
        [rng.randrange(low, workload.vocab_size) for _ in range(workload.input_len)]
        for _ in range(workload.num_prompts)
    ]


class _NoProgressBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, is_enabled: bool) -> Any:
    """tqdm's bar on stderr where tqdm is installed (the light splitserve-client has no tqdm)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoProgressBar()
    return tqdm(total=total, disable=not is_enabled, desc="requests", leave=False)


async def _one(
    generate: GenerateFn, prompt: list[int], workload: Workload, on_done: Callable[[], None]
) -> RequestResult:
    result = RequestResult(sent=time.perf_counter())
    try:
        async for num_new in generate(prompt, workload):
            now = time.perf_counter()
            result.token_times.extend([now] * num_new)
            result.num_tokens += num_new
    except Exception as exc:  # reported per request, the run goes on
        result.error = repr(exc)
    on_done()
    return result


async def run_workload(
    generate: GenerateFn, workload: Workload, progress: bool = True
) -> tuple[list[RequestResult], float]:
    """Send every request (Poisson arrivals or all at once); returns results and duration."""
    bar = progress_bar(workload.num_prompts, progress)
    rng = random.Random(workload.seed + 1)
    start = time.perf_counter()
    tasks: list[Awaitable[RequestResult]] = []
    for prompt in random_prompts(workload):
        tasks.append(asyncio.ensure_future(_one(generate, prompt, workload, bar.update)))
        if workload.request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(workload.request_rate))
    results = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - start
    bar.close()
    return results, duration


def _stats(values: list[float], prefix: str) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

    return {
        f"mean_{prefix}_ms": statistics.fmean(values) * 1e3,
        f"p50_{prefix}_ms": pct(0.5) * 1e3,
        f"p99_{prefix}_ms": pct(0.99) * 1e3,
    }


def summarize(results: list[RequestResult], duration: float) -> dict[str, float]:
    ok = [r for r in results if not r.error and r.num_tokens]
    itls = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    output_tokens = sum(r.num_tokens for r in ok)
    summary: dict[str, float] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_output_tokens": output_tokens,
    }
    summary |= _stats([r.ttft for r in ok], "ttft")
    summary |= _stats([t for r in ok if (t := r.tpot) is not None], "tpot")
    summary |= _stats(itls, "itl")
    return summary


def grpc_generate(
    addr: str, structured_outputs: types_pb2.StructuredOutputsParams | None = None
) -> tuple[GenerateFn, Callable[[], Awaitable[None]]]:
    """A GenerateFn over the public gRPC API (each request under `structured_outputs` when
    given), and a closer for its channel."""
    channel = grpc.aio.insecure_channel(addr)
    stub = gen_grpc.GenerationServiceStub(channel)

    async def generate(prompt: list[int], workload: Workload) -> AsyncIterator[int]:
        params = types_pb2.SamplingParams(
            max_tokens=workload.output_len,
            ignore_eos=workload.ignore_eos,
            temperature=workload.temperature,
        )
        request = gen_pb2.GenerateRequest(
            prompt_token_ids=gen_pb2.TokenIds(ids=prompt),
            sampling_params=params,
            structured_outputs=structured_outputs,
        )
        async for response in stub.Generate(request):
            yield len(response.token_ids)

    return generate, channel.close


async def vocab_size_of(addr: str) -> int:
    async with grpc.aio.insecure_channel(addr) as channel:
        info = await gen_grpc.GenerationServiceStub(channel).GetModelInfo(
            gen_pb2.GetModelInfoRequest(), timeout=30
        )
        return int(info.vocab_size)


def build_parser() -> FlagParser:
    p = FlagParser(
        prog="splitserve bench serve",
        description="Benchmark a running frontend (like `vllm bench serve`).",
    )
    p.add_argument("--addr", default="", help=ADDR_HELP)
    p.add_argument("--num-prompts", type=positive_int, default=32)
    p.add_argument("--input-len", type=positive_int, default=256, help="prompt tokens")
    p.add_argument("--output-len", type=positive_int, default=64, help="tokens to generate")
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, Poisson arrivals (inf: all at once)",
    )
    p.add_argument("--no-ignore-eos", action="store_true", help="let EOS end requests early")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    return p


def print_table(title: str, summary: Mapping[str, float]) -> None:
    print(f"============ {title} ============")
    for key, value in summary.items():
        print(f"{key:<24}{value:>14.2f}" if isinstance(value, float) else f"{key:<24}{value:>14}")


async def _amain(argv: Sequence[str] | None) -> int:
    args = build_parser().parse(argv, os.environ)
    addr = args.addr or default_address(os.environ)
    workload = Workload(
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.request_rate,
        not args.no_ignore_eos,
        args.temperature,
        await vocab_size_of(addr),
        args.seed,
    )
    generate, close = grpc_generate(addr)
    results, duration = await run_workload(generate, workload)
    await close()
    summary = summarize(results, duration)
    if args.json:
        print(json.dumps(summary))
    else:
        print_table("Serving Benchmark Result", summary)
    return 0 if not summary["failed"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    return asyncio.run(_amain(argv))

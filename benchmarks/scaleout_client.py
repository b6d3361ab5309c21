"""The scale-out benchmark's client: chat sessions through the gateway's OpenAI API, streamed, each
turn sent at its arrival time once its session's previous answer is in (benchmarks/
scaleout_workload.py), and the engines' own prefix-cache counters read around a run.

TTFT = the first chunk carrying content (or the end) - the request sent, on this client's
clock; a request that does not end with `max_tokens` tokens (finish_reason "length", the usage
chunk's count) is failed.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from benchmarks.peer_http import post_sse_json
from benchmarks.peer_stats import percentile
from benchmarks.scaleout_workload import OUTPUT_TOKENS, Session, Turn, Workload
from splitserve_client.bench_serve import RequestResult

PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
TTFT_BOUND_S = 2.0


async def chat_turn(
    host: str, port: int, model: str, session: Session, turn: Turn
) -> RequestResult:
    body = {
        "model": model,
        "messages": session.messages(turn.index),
        "max_tokens": OUTPUT_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(sent=time.perf_counter())
    answer, finish = [], None
    try:
        async for chunk in post_sse_json(host, port, "/v1/chat/completions", body):
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content") or ""
                if content:
                    answer.append(content)
                    result.token_times.append(time.perf_counter())
                finish = choice.get("finish_reason") or finish
            if chunk.get("usage"):
                result.num_tokens = int(chunk["usage"]["completion_tokens"])
        if not result.token_times:
            result.token_times.append(time.perf_counter())
        if finish != "length" or result.num_tokens != OUTPUT_TOKENS:
            result.error = f"finish {finish}, {result.num_tokens} of {OUTPUT_TOKENS} tokens"
    except Exception as exc:  # reported per request, the run goes on
        result.error = repr(exc)
    session.answers.append("".join(answer))
    return result


async def _session(
    host: str, port: int, model: str, session: Session, start: float
) -> list[RequestResult]:
    results = []
    for turn in session.turns:
        delay = start + turn.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        results.append(await chat_turn(host, port, model, session, turn))
    return results


async def run_sessions(
    url: str, model: str, workload: Workload
) -> tuple[list[RequestResult], float]:
    """Every session's turns, in order, at their arrival times; (results, wall time)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    start = time.perf_counter()
    per_session = await asyncio.gather(
        *(_session(host, int(port), model, s, start) for s in workload.sessions)
    )
    return [r for rs in per_session for r in rs], time.perf_counter() - start


def counters(metrics_urls: Sequence[str], names: Sequence[str]) -> dict[str, float]:
    """Each counter summed over the engines' /metrics."""
    totals = dict.fromkeys(names, 0.0)
    for url in metrics_urls:
        with urllib.request.urlopen(url, timeout=10) as reply:
            for line in reply.read().decode().splitlines():
                name = line.split("{", 1)[0].split(" ", 1)[0]
                if name in totals:
                    totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


@dataclass(frozen=True)
class RunStats:
    """One run of one workload at one rate."""

    rate: float
    hit_rate: float
    ttft_p50_s: float
    ttft_p90_s: float
    output_tok_s: float
    num_failed: int

    @property
    def is_sustained(self) -> bool:
        return self.num_failed == 0 and self.ttft_p90_s <= TTFT_BOUND_S


def run_stats(
    rate: float,
    results: Sequence[RequestResult],
    wall_s: float,
    before: Mapping[str, float],
    after: Mapping[str, float],
) -> RunStats:
    ok = [r for r in results if not r.error]
    ttfts = [r.ttft for r in ok] or [float("inf")]
    queries = after[PREFIX_QUERIES] - before[PREFIX_QUERIES]
    hits = after[PREFIX_HITS] - before[PREFIX_HITS]
    return RunStats(
        rate=rate,
        hit_rate=hits / queries if queries else 0.0,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
        output_tok_s=sum(r.num_tokens for r in ok) / wall_s,
        num_failed=len(results) - len(ok),
    )

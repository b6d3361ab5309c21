"""The scale-out benchmark's client: chat sessions through the gateway's OpenAI API, streamed, each
turn sent at its arrival time once its session's previous answer is in (benchmarks/
scaleout_workload.py), and the engines' own prefix-cache counters read around a run.

TTFT = the first chunk carrying content (or the end) - the request sent, on this client's
clock. Every request ends in one of `OUTCOMES`: complete (all `max_tokens` tokens, finish_reason
"length", the usage chunk's count), error (an HTTP error status, an error event or a broken
stream: the client knows and may retry), truncated (a normal end with fewer tokens: a silent
loss) or hung (no end within `HANG_S`); all but complete are failed.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from benchmarks.peer_http import post_sse_json
from benchmarks.peer_stats import percentile
from benchmarks.scaleout_workload import Session, Turn, Workload
from splitserve_client.bench_serve import RequestResult

PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
TTFT_BOUND_S = 2.0
HANG_S = 300.0
"""A request not ended after this long is hung (a loaded run's longest lasts well under it)."""
OUTCOMES = ("complete", "error", "truncated", "hung")


class Truncated(Exception):
    """A stream that ended normally with fewer tokens than asked for."""


async def chat_turn(
    host: str, port: int, model: str, session: Session, turn: Turn, max_tokens: int
) -> RequestResult:
    """One streamed chat turn; its result's `error` starts with its outcome when not complete."""
    result = RequestResult(sent=time.perf_counter())
    answer: list[str] = []
    try:
        body = _body(model, session.messages(turn.index), max_tokens)
        await asyncio.wait_for(_stream(host, port, body, result, answer), HANG_S)
    except TimeoutError:
        result.error = f"hung: no end after {HANG_S:g} s"
    except Truncated as exc:
        result.error = f"truncated: {exc}"
    except Exception as exc:  # reported per request, the run goes on
        result.error = f"error: {exc!r}"
    if not result.token_times:
        result.token_times.append(time.perf_counter())
    session.answers.append("".join(answer))
    return result


def outcome(result: RequestResult) -> str:
    return result.error.split(":", 1)[0] if result.error else "complete"


def _body(model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, object]:
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _stream(
    host: str, port: int, body: dict[str, object], result: RequestResult, answer: list[str]
) -> None:
    finish = None
    async for chunk in post_sse_json(host, port, "/v1/chat/completions", body):
        for choice in chunk.get("choices") or []:
            content = (choice.get("delta") or {}).get("content") or ""
            if content:
                answer.append(content)
                result.token_times.append(time.perf_counter())
            finish = choice.get("finish_reason") or finish
        if chunk.get("usage"):
            result.num_tokens = int(chunk["usage"]["completion_tokens"])
    if finish != "length" or result.num_tokens != body["max_tokens"]:
        raise Truncated(f"finish {finish}, {result.num_tokens} of {body['max_tokens']} tokens")


async def _session(
    host: str, port: int, model: str, session: Session, start: float, max_tokens: int
) -> list[RequestResult]:
    results = []
    for turn in session.turns:
        delay = start + turn.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        results.append(await chat_turn(host, port, model, session, turn, max_tokens))
    return results


async def run_sessions(
    url: str, model: str, workload: Workload
) -> tuple[list[RequestResult], float]:
    """Every session's turns, in order, at their arrival times; (results, wall time)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    start = time.perf_counter()
    per_session = await asyncio.gather(
        *(
            _session(host, int(port), model, s, start, workload.output_tokens)
            for s in workload.sessions
        )  # fmt: skip
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

"""Routing's own cost (benchmarks/scaleout.py): what the gateway adds per request over a direct
call to an engine, in the same run on the same engines.

Pairs of one-token completions (`/v1/completions`, greedy, a 24-word prompt of its own each, so
no prefix is cached anywhere), sent one at a time: one to engine 0's own OpenAI server, one
through the gateway (which routes it over the engine contract to either engine), alternating
which goes first. Reported: p50 and p99 of each path's end-to-end latency on this client's clock
and their differences.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.peer_http import post_json
from benchmarks.peer_stats import percentile

PAIRS = 60
PROMPT_WORDS = 24


@dataclass(frozen=True)
class RoutingCost:
    direct_p50_ms: float
    direct_p99_ms: float
    gateway_p50_ms: float
    gateway_p99_ms: float

    @property
    def added_p50_ms(self) -> float:
        return self.gateway_p50_ms - self.direct_p50_ms

    @property
    def added_p99_ms(self) -> float:
        return self.gateway_p99_ms - self.direct_p99_ms


def _completion(http: str, model: str, prompt: str) -> float:
    """One non-streamed one-token completion; its latency in ms."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    started = time.perf_counter()
    post_json(f"http://{http}/v1/completions", body)
    return 1e3 * (time.perf_counter() - started)


def routing_cost(
    gateway_http: str, engine_http: str, model: str, words: Sequence[str], pairs: int = PAIRS
) -> RoutingCost:
    rng = random.Random(7)
    direct: list[float] = []
    gateway: list[float] = []
    for i in range(pairs):
        a, b = (" ".join(rng.choices(words, k=PROMPT_WORDS)) for _ in range(2))
        if i % 2:
            gateway.append(_completion(gateway_http, model, a))
            direct.append(_completion(engine_http, model, b))
        else:
            direct.append(_completion(engine_http, model, a))
            gateway.append(_completion(gateway_http, model, b))
    cost = RoutingCost(percentile(direct, 50), percentile(direct, 99),
                       percentile(gateway, 50), percentile(gateway, 99))  # fmt: skip
    print(f"    routing: {cost} (added p50 {cost.added_p50_ms:.2f} ms)", flush=True)
    return cost

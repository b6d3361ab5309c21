"""The side-by-side benchmark's workloads: the same token-id requests for splitserve and vLLM.

Every request is greedy, ignore_eos, min_tokens = max_tokens, so both systems generate exactly
`max_tokens` tokens. Each workload draws its prompt tokens from its own seed, so no two
workloads (nor two W2 repeats) share a prompt: prefix caching, on by default in both systems,
never turns a timed prefill into a cache hit.

- W1: 32 x (256 in, 64 out), all at once -> output tok/s.
- W2: 1 x (256 in, 128 out) -> TTFT and TPOT.
- W3: 64 requests, input 128-384, output 48-144, Poisson arrivals at 2 req/s -> TTFT/ITL p99.
- W3-burst: the same 64 lengths, all at once -> output tok/s.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FIRST_ORDINARY_TOKEN_ID = 3  # ids 0-2 are the benchmark tokenizer's special tokens


@dataclass(frozen=True)
class RequestSpec:
    """One request: its prompt, how many tokens it generates, when it is sent."""

    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    arrival_s: float = 0.0


@dataclass(frozen=True)
class Workload:
    """A named list of requests (sent at their arrival times, relative to the workload start)."""

    name: str
    requests: tuple[RequestSpec, ...]

    @property
    def num_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)


def random_prompt(rng: random.Random, num_tokens: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.randrange(FIRST_ORDINARY_TOKEN_ID, vocab_size) for _ in range(num_tokens))


def seeded(seed: int, purpose: str) -> random.Random:
    """A generator for one purpose: string seeds are hashed (sha512), so the streams for
    "tokens", "shapes" and "arrivals" of one seed are independent and stable across runs."""
    return random.Random(f"{seed}:{purpose}")


def fixed_shape(
    name: str, num_requests: int, input_len: int, output_len: int, vocab_size: int, seed: int
) -> Workload:
    """`num_requests` x (`input_len` in, `output_len` out), all sent at once."""
    tokens = seeded(seed, "tokens")
    requests = tuple(
        RequestSpec(random_prompt(tokens, input_len, vocab_size), output_len)
        for _ in range(num_requests)
    )
    return Workload(name, requests)


def poisson_arrivals(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send times (s) of a Poisson process at `request_rate` req/s, the first at 0; all 0 when
    the rate is infinite (a burst)."""
    if request_rate == float("inf"):
        return [0.0] * num_requests
    rng = seeded(seed, "arrivals")
    times = [0.0]
    for _ in range(num_requests - 1):
        times.append(times[-1] + rng.expovariate(request_rate))
    return times


def mixed(
    name: str,
    num_requests: int,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    request_rate: float,
    vocab_size: int,
    seed: int,
) -> Workload:
    """Lengths drawn uniformly from the (inclusive) ranges, sent at Poisson arrivals of
    `request_rate` req/s (all at once when infinite). W3 and W3-burst share `seed`, so they
    carry the same 64 shapes; their prompt tokens differ (the tokens' stream is named after
    the workload), so the burst never hits the prefix cache W3 filled."""
    shapes = seeded(seed, "shapes")
    lengths = [
        (shapes.randint(*input_range), shapes.randint(*output_range)) for _ in range(num_requests)
    ]
    arrivals = poisson_arrivals(num_requests, request_rate, seed)
    tokens = seeded(seed, f"tokens:{name}")
    requests = tuple(
        RequestSpec(random_prompt(tokens, num_in, vocab_size), num_out, at)
        for (num_in, num_out), at in zip(lengths, arrivals, strict=True)
    )
    return Workload(name, requests)


@dataclass(frozen=True)
class Suite:
    """Everything one server runs in one round, in order."""

    warmup: Workload
    w1: Workload
    w2_repeats: tuple[Workload, ...]
    w3: Workload
    w3_burst: Workload


def build_suite(vocab_size: int, seed: int = 0, num_w2_repeats: int = 3) -> Suite:
    """The benchmark's workloads; the same `seed` gives the same requests, token for token."""
    return Suite(
        warmup=fixed_shape("warmup", 1, 16, 4, vocab_size, seed + 100),
        w1=fixed_shape("W1", 32, 256, 64, vocab_size, seed + 1),
        w2_repeats=tuple(
            fixed_shape("W2", 1, 256, 128, vocab_size, seed + 200 + i)
            for i in range(num_w2_repeats)
        ),
        w3=mixed("W3", 64, (128, 384), (48, 144), 2.0, vocab_size, seed + 3),
        w3_burst=mixed("W3-burst", 64, (128, 384), (48, 144), float("inf"), vocab_size, seed + 3),
    )

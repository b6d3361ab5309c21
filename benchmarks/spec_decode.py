"""`python -m benchmarks.spec_decode [--rounds N]` (`make bench-spec`): what n-gram speculative
decoding buys on the default model (SmolLM2-135M-Instruct), A/B in one run.

Starts two splitserve stacks, one plain and one with `--speculative-config` (n-gram, k drafts),
both up at once, and alternates the workloads between them for N rounds (the side that goes
first alternates too), so a busy machine's drift hits both alike:

- copy, batch 1: a chat prompt whose answer copies its input ("Repeat this text exactly: ...");
- free, batch 1: a chat prompt with nothing to copy (a short story), greedy; SmolLM2's greedy
  prose repeats its own phrases, so the proposer still finds drafts there;
- free, batch 1, T=0.8 (seeded): sampled prose, which repeats itself far less;
- batch 32: 32 requests at once, copy and free prompts mixed (the step's batch switches
  speculation off by default: --speculative-config's per-batch-size schedule);

with a fixed max_tokens (96 at batch 1, 48 at batch 32). Per round it prints the client's mean
TPOT (and output tok/s for the batch), the spec side's acceptance (from its core's
vllm:spec_decode_* counters) and whether both sides produced the same tokens (in bfloat16 a
verification forward's matmuls over 1 + k rows may round differently from a one-row decode, so a
near-tie can flip; `--dtype float32` compares bit for bit); then the medians of the per-round
ratios, the acceptance rate and the load average. `--crossover` instead measures TPOT at several
batch sizes with speculation forced on at every size, which is how the default schedule's
cut-off is checked. `make bench-spec` runs the workers with one OMP thread (as bench-tracing):
on a shared 2-core machine two-thread barriers make step times swing several-fold.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.serve_compare import stack_options
from splitserve.children import Child, start_children, stop_children, wait_ready
from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc
from splitserve_runtime.default_model import ensure_default_model

BASE_FLAGS = [
    "--dtype",
    "bfloat16",
    "--max-num-seqs",
    "64",
    "--kv-cache-memory-bytes",
    str(1 << 30),
]
NUM_SPEC_TOKENS = 4
SPEC = {"method": "ngram", "num_speculative_tokens": NUM_SPEC_TOKENS, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2}  # fmt: skip
PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, "
    "polished the great lens and wound the clockwork that turned the light. Ships far out at sea "
    "counted the flashes to know which coast they were passing. In winter the storms rattled the "
    "windows and salt crusted the glass, but the light never failed."
)
COPY = f"Repeat the following text exactly, word for word, and nothing else:\n\n{PASSAGE}"
FREE = [
    "Write a short story about a robot who learns to paint.",
    "Describe your ideal weekend in a few sentences.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give three tips for learning a new language.",
]
MAX_TOKENS = 96
SETTLE_SECONDS = 1.0
"""Pause before each side's turn, so the other stack's wind-down (OMP spin, outputs) is over."""


@dataclass
class Result:
    tpot_ms: float
    tok_s: float
    token_ids: list[list[int]]


async def _one(
    stub: gen_grpc.GenerationServiceStub, prompt: str, max_tokens: int, temperature: float
) -> tuple[list[float], list[int]]:
    params = types_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature)
    if temperature:
        params.seed = 7  # seeded: the same tokens with and without drafts
    request = gen_pb2.GenerateRequest(
        chat=gen_pb2.Chat(messages=[gen_pb2.ChatMessage(role="user", content=prompt)]),
        sampling_params=params,
    )
    times: list[float] = []
    tokens: list[int] = []
    async for response in stub.Generate(request):
        now = time.perf_counter()
        times.extend([now] * len(response.token_ids))
        tokens.extend(response.token_ids)
    return times, tokens


async def run_batch(
    addr: str, prompts: list[str], max_tokens: int = MAX_TOKENS, temperature: float = 0.0
) -> Result:
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = gen_grpc.GenerationServiceStub(channel)
        started = time.perf_counter()
        done = await asyncio.gather(*(_one(stub, p, max_tokens, temperature) for p in prompts))
        duration = time.perf_counter() - started
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for t, _ in done if len(t) > 1]
    num_tokens = sum(len(tokens) for _, tokens in done)
    return Result(1e3 * statistics.mean(tpots), num_tokens / duration, [t for _, t in done])


def spec_counters(core: Child) -> dict[str, float]:
    with urllib.request.urlopen(core.metrics_url, timeout=10) as reply:  # noqa: S310
        text = reply.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:spec_decode_num_") and sample.name.endswith("_total"):
                key = sample.name + sample.labels.get("position", "")
                out[key] = out.get(key, 0.0) + sample.value
    return out


def _start(model: str, flags: list[str]) -> list[Child]:
    children = start_children(stack_options(model, [*BASE_FLAGS, *flags]))
    wait_ready(children, 900.0)
    return children


WORKLOADS = {  # name: (prompts, temperature)
    "copy b1": ([COPY], 0.0),
    "free b1": ([FREE[0]], 0.0),
    "free b1 T=0.8": ([FREE[2]], 0.8),
    "b32": ([COPY if i % 2 else FREE[i % len(FREE)] for i in range(32)], 0.0),
}


async def ab(rounds: int, spec: dict[str, object]) -> list[dict[str, object]]:
    model = str(ensure_default_model())
    sides = {"plain": [], "spec": ["--speculative-config", json.dumps(spec)]}
    stacks: dict[str, list[Child]] = {}
    rows: list[dict[str, object]] = []
    try:
        for name, flags in sides.items():
            stacks[name] = await asyncio.to_thread(_start, model, flags)
            await run_batch(stacks[name][-1].address, [FREE[1]], 16)  # warm-up
        core = next(c for c in stacks["spec"] if c.name == "core")
        for i in range(rounds):
            for workload, (prompts, temperature) in WORKLOADS.items():
                order = list(sides) if i % 2 == 0 else list(reversed(sides))
                results: dict[str, Result] = {}
                before = await asyncio.to_thread(spec_counters, core)
                for name in order:
                    await asyncio.sleep(SETTLE_SECONDS)
                    max_tokens = MAX_TOKENS if len(prompts) == 1 else MAX_TOKENS // 2
                    results[name] = await run_batch(
                        stacks[name][-1].address, prompts, max_tokens, temperature
                    )
                after = await asyncio.to_thread(spec_counters, core)
                rows.append(_row(i, workload, results, before, after))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        for children in stacks.values():
            await asyncio.to_thread(stop_children, children)
    return rows


def _row(
    i: int,
    workload: str,
    results: dict[str, Result],
    before: dict[str, float],
    after: dict[str, float],
) -> dict[str, object]:
    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    drafted = delta("vllm:spec_decode_num_draft_tokens_total")
    plain, spec = results["plain"], results["spec"]
    return {
        "round": i,
        "workload": workload,
        "plain_tpot_ms": round(plain.tpot_ms, 2),
        "spec_tpot_ms": round(spec.tpot_ms, 2),
        "tpot_ratio": round(spec.tpot_ms / plain.tpot_ms, 3),
        "num_tokens": sum(len(t) for t in plain.token_ids),
        "plain_tok_s": round(plain.tok_s, 1),
        "spec_tok_s": round(spec.tok_s, 1),
        "drafts": delta("vllm:spec_decode_num_drafts_total"),
        "acceptance": round(delta("vllm:spec_decode_num_accepted_tokens_total") / drafted, 3)
        if drafted
        else None,
        "identical": plain.token_ids == spec.token_ids,
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def report(rows: list[dict[str, object]]) -> None:
    print("\n| workload | median TPOT plain ms | median TPOT spec ms | median ratio | "
          "balanced ratio | median tok/s ratio | acceptance | identical | load avg |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|")
    for workload in WORKLOADS:
        mine = [r for r in rows if r["workload"] == workload]

        def med(key: str, rows: list[dict[str, object]] = mine) -> float:
            return statistics.median(float(r[key]) for r in rows)  # type: ignore[arg-type]

        tok_ratio = statistics.median(
            float(r["spec_tok_s"]) / float(r["plain_tok_s"])  # type: ignore[arg-type]
            for r in mine
        )
        accepted = [float(r["acceptance"]) for r in mine if r["acceptance"] is not None]  # type: ignore[arg-type]
        acceptance = f"{statistics.median(accepted):.2f}" if accepted else "-"
        identical = all(r["identical"] for r in mine)
        print(
            f"| {workload} | {med('plain_tpot_ms'):.2f} | {med('spec_tpot_ms'):.2f} | "
            f"{med('tpot_ratio'):.3f} | {balanced(mine):.3f} | {tok_ratio:.3f} | {acceptance} | "
            f"{identical} | "
            f"{med('loadavg_1m'):.1f} |"
        )


def balanced(rows: list[dict[str, object]]) -> float:
    """Geometric mean of the TPOT ratios of as many plain-first rounds (even) as spec-first ones
    (odd): whichever side runs first pays for the other's wind-down, so the orders pair up."""
    firsts: list[list[float]] = [[], []]
    for row in rows:
        firsts[int(str(row["round"])) % 2].append(float(str(row["tpot_ratio"])))
    num_pairs = min(len(firsts[0]), len(firsts[1])) or 1
    ratios = firsts[0][:num_pairs] + firsts[1][:num_pairs]
    return math.exp(statistics.fmean(math.log(r) for r in ratios))


async def crossover(rounds: int, batches: Sequence[int]) -> None:
    """TPOT with speculation forced on at every batch size against none, copy and free prompts
    mixed: where the ratio crosses 1 is the default schedule's cut-off."""
    forced = {**SPEC, "num_speculative_tokens_per_batch_size": [[1, 256, NUM_SPEC_TOKENS]]}
    model = str(ensure_default_model())
    sides = {"plain": [], "spec": ["--speculative-config", json.dumps(forced)]}
    stacks = {name: await asyncio.to_thread(_start, model, flags) for name, flags in sides.items()}
    ratios: dict[int, list[float]] = {b: [] for b in batches}
    try:
        for i in range(rounds):
            for batch in batches:
                prompts = [COPY if j % 2 else FREE[j % len(FREE)] for j in range(batch)]
                order = list(sides) if i % 2 == 0 else list(reversed(sides))
                tpot = {
                    n: (await run_batch(stacks[n][-1].address, prompts, 48)).tpot_ms for n in order
                }
                ratios[batch].append(tpot["spec"] / tpot["plain"])
                print(json.dumps({"round": i, "batch": batch, **tpot, "load": os.getloadavg()[0]}))
    finally:
        for children in stacks.values():
            await asyncio.to_thread(stop_children, children)
    print("\n| batch | median TPOT ratio spec/plain (forced on) |\n|---:|---:|")
    for batch, values in ratios.items():
        print(f"| {batch} | {statistics.median(values):.3f} |")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--crossover", action="store_true")
    parser.add_argument("--batches", default="1,2,4,8,16")
    parser.add_argument("--dtype", default="bfloat16", help="float32: greedy outputs bit-exact")
    parser.add_argument(
        "--aa", action="store_true", help="A/A: the spec side never speculates (k=0 at any batch)"
    )
    args = parser.parse_args(argv)
    BASE_FLAGS[BASE_FLAGS.index("--dtype") + 1] = args.dtype
    if args.crossover:
        asyncio.run(crossover(args.rounds, [int(b) for b in args.batches.split(",")]))
    else:
        spec = {**SPEC, "num_speculative_tokens_per_batch_size": [[1, 256, 0]]} if args.aa else SPEC
        report(asyncio.run(ab(args.rounds, spec)))


if __name__ == "__main__":
    main()

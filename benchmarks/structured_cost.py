"""`python -m benchmarks.structured_cost`: what a JSON-schema constraint costs, in one run.

One splitserve stack (worker, core, frontend processes) on the ~100M benchmark checkpoint of
benchmarks/bench_model.py, driven through the public gRPC API, two measurements:

1. TPOT, constrained vs not, at batch 1 (W2's 256 random prompt tokens, 64 output tokens) and
   batch 32 (32 requests of 64 prompt and 32 output tokens, all at once); greedy, ignore_eos;
   shorter than W2 so the run stays within a couple of minutes on a shared 2-core box. The
   constrained side sends `structured_outputs.json` = benchmarks/structured_schemas.RECORDS,
   whose shortest valid document is far longer than 64 tokens, so the grammar cannot end the
   request early and every measured token is masked (keys, numbers, strings, enums). TPOT is
   the client's (last token - first token) / (generated tokens - 1), per request, averaged
   over the batch; only generated tokens count, and a round where a request got fewer tokens
   than asked is reported as failed. Rounds alternate plain / constrained (the order flips every
   round) so this shared machine's drift hits both sides alike, each side with prompts of its
   own (the same prompts would be prefix-cache hits for the side that runs second: a faster
   prefill, a different admission, a bias that flips with the order); the report gives each side's
   min and median and the ratio of medians, and the same for the CPU time the stack's three
   processes used per generated token (robust to other jobs taking the cores) (targets: <= 1.10 at batch 1, <= 1.05 at batch 32).
2. (First, on the fresh stack.) Other streams' inter-token latency while a grammar compiles. 8 unconstrained streams decode;
   meanwhile up to 24 probes (8-token prompt, 1 output token) arrive one at a time, each followed
   by a pause as long as it took (at least 0.3 s), alternately with a cold
   20-field schema (a new field name each time: a cache miss, compiled on the core's compile
   pool) and with a schema already compiled (a cache hit: same path, no compile). Each probe's
   window is [sent, its first token]; the streams' gaps that overlap a cold window, a warm
   window, or no window are reported apart (p50/p99).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from benchmarks.bench_model import VOCAB_SIZE, ensure_bench_model
from benchmarks.flag_ab import cpu_seconds
from benchmarks.serve_compare import stack_options
from benchmarks.structured_schemas import RECORDS, as_text, twenty_fields
from splitserve.children import Child, start_children, stop_children, wait_ready
from splitserve_client.bench_serve import (
    GenerateFn,
    RequestResult,
    Workload,
    grpc_generate,
    run_workload,
    summarize,
)
from splitserve_contracts.common.v1 import types_pb2

CORE_FLAGS = ["--dtype", "bfloat16", "--max-num-seqs", "64", "--max-num-batched-tokens", "8192"]
BATCHES = {
    "batch_1": Workload(num_prompts=1, input_len=256, output_len=64, vocab_size=VOCAB_SIZE),
    "batch_32": Workload(num_prompts=32, input_len=64, output_len=32, vocab_size=VOCAB_SIZE),
}
TARGETS = {"batch_1": 1.10, "batch_32": 1.05}
STREAMS = Workload(num_prompts=8, input_len=32, output_len=384, vocab_size=VOCAB_SIZE, seed=7)
PROBE = Workload(num_prompts=1, input_len=8, output_len=1, vocab_size=VOCAB_SIZE, seed=9)
PROBE_EVERY_S = 0.3
MAX_PROBES = 24
Round = tuple[float, float] | None
"""One round of one side: (mean TPOT ms, stack CPU ms per generated token), None if failed."""


def json_constraint(schema: dict[str, Any]) -> types_pb2.StructuredOutputsParams:
    return types_pb2.StructuredOutputsParams(json=as_text(schema))


async def tpot_round(
    generate: GenerateFn, workload: Workload, children: Sequence[Child]
) -> tuple[float, float] | None:
    """Mean TPOT (ms) of one batch, and the stack's CPU ms per generated token (less sensitive
    than time to other work on a shared machine); None when a request failed or stopped short."""
    cpu_before = cpu_seconds(children)
    results, duration = await run_workload(generate, workload, progress=False)
    cpu_ms = 1e3 * (cpu_seconds(children) - cpu_before)
    if any(r.error or r.num_tokens != workload.output_len for r in results):
        return None
    num_tokens = workload.num_prompts * workload.output_len
    return float(summarize(results, duration)["mean_tpot_ms"]), cpu_ms / num_tokens


async def tpot_rounds(children: Sequence[Child], rounds: int) -> dict[str, dict[str, list[Round]]]:
    """{batch: {"plain": [(TPOT ms, CPU ms per token) per round], "json": [...]}}, sides
    alternating."""
    addr = children[-1].address
    sides = {
        "plain": grpc_generate(addr),
        "json": grpc_generate(addr, json_constraint(RECORDS)),
    }
    tpots: dict[str, dict[str, list[Round]]] = {b: {s: [] for s in sides} for b in BATCHES}
    warm_up = Workload(2, 32, 8, vocab_size=VOCAB_SIZE)
    try:
        for generate, _ in sides.values():
            await run_workload(generate, warm_up, progress=False)
        for i in range(rounds):
            order = list(sides) if i % 2 == 0 else list(reversed(sides))
            for batch, workload in BATCHES.items():
                for side in order:
                    seed = 2 * i + list(sides).index(side)  # no prefix-cache hits across sides
                    measured = await tpot_round(
                        sides[side][0], replace(workload, seed=seed), children
                    )
                    tpots[batch][side].append(measured)
                    row = {"round": i, "batch": batch, "side": side, "tpot_cpu_ms": measured}
                    print(json.dumps(row), flush=True)
    finally:
        for _, close in sides.values():
            await close()
    return tpots


async def probe(addr: str, schema: dict[str, Any]) -> tuple[float, float]:
    """One constrained 1-token request: (sent, first token) perf_counter times."""
    generate, close = grpc_generate(addr, json_constraint(schema))
    try:
        (result,), _ = await run_workload(generate, PROBE, progress=False)
    finally:
        await close()
    if result.error or not result.token_times:
        raise RuntimeError(f"a probe failed: {result.error}")
    return result.sent, result.token_times[0]


def overlapping_gaps(
    streams: Sequence[RequestResult], windows: Sequence[tuple[float, float]]
) -> tuple[list[float], list[float]]:
    """The streams' inter-token gaps (s) that overlap some window, and those that overlap none
    (between the first and last window only)."""
    inside: list[float] = []
    outside: list[float] = []
    first, last = min(w[0] for w in windows), max(w[1] for w in windows)
    for stream in streams:
        times = stream.token_times
        for start, end in zip(times, times[1:], strict=False):
            if end <= start or end < first or start > last:
                continue  # several tokens in one message, or outside the probing period
            hit = any(end > w0 and start < w1 for w0, w1 in windows)
            (inside if hit else outside).append(end - start)
    return inside, outside


def percentiles(gaps: Sequence[float]) -> dict[str, float]:
    ordered = sorted(gaps)
    if not ordered:
        return {"n": 0}

    def pct(q: float) -> float:
        return round(1e3 * ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))], 2)

    return {"n": len(ordered), "p50_ms": pct(0.5), "p99_ms": pct(0.99)}


async def compile_itl(addr: str) -> dict[str, Any]:
    """Other streams' ITL while cold 20-field schemas compile, vs warm ones, vs no probe."""
    await probe(addr, twenty_fields("warm"))  # compiled once: later ones are cache hits
    generate, close = grpc_generate(addr)
    streams = asyncio.ensure_future(run_workload(generate, STREAMS, progress=False))
    windows: dict[str, list[tuple[float, float]]] = {"cold": [], "warm": []}
    await asyncio.sleep(0.5)  # the streams are past their prefill
    i = 0
    while not streams.done() and i < MAX_PROBES:
        kind = "cold" if i % 2 == 0 else "warm"
        salt = uuid.uuid4().hex[:12] if kind == "cold" else "warm"
        sent, first = await probe(addr, twenty_fields(salt))
        windows[kind].append((sent, first))
        i += 1
        await asyncio.sleep(max(PROBE_EVERY_S, first - sent))  # as long again without a probe
    results, _ = await streams
    await close()
    if any(r.error for r in results):
        raise RuntimeError("a background stream failed")
    report: dict[str, Any] = {}
    all_windows = windows["cold"] + windows["warm"]
    for kind, kind_windows in windows.items():
        inside, _ = overlapping_gaps(results, kind_windows)
        latencies = [end - start for start, end in kind_windows]
        report[f"itl_during_{kind}_probe"] = percentiles(inside)
        report[f"{kind}_probe_first_token"] = percentiles(latencies)
    report["itl_without_probe"] = percentiles(overlapping_gaps(results, all_windows)[1])
    return report


def summary(tpots: dict[str, dict[str, list[Round]]]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for batch, sides in tpots.items():
        row: dict[str, Any] = {}
        for side, values in sides.items():
            ok = [v for v in values if v is not None]
            row[side] = {"failed_rounds": len(values) - len(ok)}
            for i, name in enumerate(("tpot", "cpu_per_token")):
                if ok:
                    row[side][f"{name}_min_ms"] = round(min(v[i] for v in ok), 2)
                    row[side][f"{name}_median_ms"] = round(statistics.median(v[i] for v in ok), 2)
        plain, constrained = row["plain"], row["json"]
        if "tpot_median_ms" in plain and "tpot_median_ms" in constrained:
            for key in ("tpot_median_ms", "tpot_min_ms", "cpu_per_token_median_ms"):
                row[f"ratio_{key.removesuffix('_ms')}"] = round(constrained[key] / plain[key], 3)
            row["target"] = TARGETS[batch]
            row["target_met"] = row["ratio_tpot_median"] <= TARGETS[batch]
        rows[batch] = row
    return rows


async def run(rounds: int, parts: Sequence[str], flags: Sequence[str]) -> dict[str, Any]:
    options = stack_options(str(ensure_bench_model()), [*CORE_FLAGS, *flags])
    children = start_children(options)
    try:
        await asyncio.to_thread(wait_ready, children, 600.0)
        addr = children[-1].address
        report: dict[str, Any] = {}
        if "compile" in parts:
            report["compile_itl"] = await compile_itl(addr)
            print(json.dumps(report), flush=True)
        if "tpot" in parts:
            report["tpot"] = summary(await tpot_rounds(children, rounds))
        return report
    finally:
        await asyncio.to_thread(stop_children, children)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds per batch")
    parser.add_argument(
        "--parts", nargs="+", choices=["compile", "tpot"], default=["compile", "tpot"]
    )
    parser.add_argument("flags", nargs="*", help="more engine core flags (after --)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    report = asyncio.run(run(args.rounds, args.parts, args.flags))
    for name, part in report.items():
        print(json.dumps({name: part}), flush=True)
    print(f"structured_cost: {time.perf_counter() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

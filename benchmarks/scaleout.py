"""`make bench-scaleout` / `python -m benchmarks.scaleout`: does cache-aware routing over several
engines pay off on a shared-prefix workload, do the engines' KV events earn their port, and what
do clients see when an engine is lost under load? (issues 24 and 40; docs/benchmarks.md,
"Scale-out").

Each variant is one command, `splitserve serve MODEL --data-parallel-size N --router POLICY`: N
engines (4 by default, one torch thread each, each with a KV cache of 0.35x the workload's
working set, so that the cache must be used well) and the real smg gateway in front:

- round_robin;
- cache_aware fed by the engines' KV-cache events (what `--router cache_aware` sets up);
- cache_aware without events (`--kv-events-config '{"enable_kv_cache_events": false}'`): smg
  routes on its own approximate tree of what it sent where;
- the anchor: the same gateway over vLLM-CPU engines (`vllm serve --grpc`, events on).

Per round, each variant on a fresh stack (a round's last variant is the next round's first: its
stack is kept, which saves one start of the vLLM anchor's four engines, ~3 minutes), variants
alternating their order (ABC, CBA, ...), each workload on flushed caches and with prompts of its
own (a new seed):

1. every variant: SP-MT (benchmarks/scaleout_workload.py; SP-MT-8 by default) at the reference
   arrival rate: the engines' own prefix-cache token hit rate (`vllm:prefix_cache_hits` /
   `queries` from the engine cores' /metrics, not the gateway's prediction), TTFT p50 / p90,
   output tok/s;
2. `sweep` (round_robin, cache_aware+events): the sweep's higher rates while TTFT p90 stays
   within 2 s and no request fails (or, where the reference rate is not sustained, its lower
   rates until one is, each with fewer sessions per group: `below_reference`): the highest
   sustained rate;
3. `control` (round_robin, cache_aware+events): the no-sharing control, its arrivals at a rate
   above what the engines sustain: output tok/s at capacity;
4. `divergence` (both cache_aware variants), right after step 1, whose sessions the caches hold:
   the engines' caches made to differ from what the gateway's own tree believes. Returning
   sessions of step 1's groups arrive fast while engine 0's worker rank is SIGKILLed 0.5 s into
   them (the supervisor restarts it; the core recovers with an empty cache); the gateway sends
   what engine 0 held to the other engines meanwhile. Once engine 0 is routable again, more
   returning sessions: their hit rate is what routing on the engines' real caches earns over
   routing on the tree (which still says engine 0). The kill is also the lost-engine case for
   a worker rank (benchmarks/scaleout_faults.py);
5. `core-fault` (round_robin): the no-sharing workload at the reference rate with engine 0's
   engine core killed 3 s in: the lost-engine case for an engine core;
6. `routing` (cache_aware+events): one-token requests to engine 0 directly and through the
   gateway, alternating (benchmarks/scaleout_routing.py).

Every run goes to .bench/scaleout-results.json; the tables (benchmarks/scaleout_report.py) are
printed at the end. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import common_pb2

from benchmarks.peer_servers import ServerError
from benchmarks.scaleout_client import (
    PREFIX_HITS,
    PREFIX_QUERIES,
    RunStats,
    counters,
    run_sessions,
    run_stats,
)
from benchmarks.scaleout_faults import run_with_fault, wait_routable
from benchmarks.scaleout_model import DTYPE_BYTES, prepare
from benchmarks.scaleout_oracle import Encode, oracle_hit_rate
from benchmarks.scaleout_report import render
from benchmarks.scaleout_routing import routing_cost
from benchmarks.scaleout_targets import Target, splitserve_target, vllm_target
from benchmarks.scaleout_workload import (
    SHAPES,
    Shape,
    Workload,
    no_sharing,
    returning,
    sp_mt,
)

BENCH_DIR = Path(".bench")
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "round_robin": ("round_robin", []),
    "cache_aware+events": ("cache_aware", []),
    "cache_aware-no-events": (
        "cache_aware",
        ["--kv-events-config", '{"enable_kv_cache_events": false}'],
    ),
    "vllm:round_robin": ("round_robin", []),
    "vllm:cache_aware+events": ("cache_aware", []),
}
STEPS: dict[str, tuple[str, ...]] = {
    "round_robin": ("sweep", "control", "core-fault"),
    "cache_aware+events": ("divergence", "sweep", "control", "routing"),
    "cache_aware-no-events": ("divergence",),
}
"""What each variant runs after SP-MT at the reference rate (the vLLM anchor: nothing more)."""
DEFAULT_VARIANTS = "round_robin,cache_aware+events,cache_aware-no-events,vllm:cache_aware+events"
DEFAULT_VLLM_PYTHON = BENCH_DIR / "vllm-venv" / "bin" / "python"
RESULTS = BENCH_DIR / "scaleout-results.json"
OUTAGE_RATE = 8.0
"""The divergence step's returning sessions during engine 0's outage, req/s."""
DIVERGENCE_FAULT = "worker"
"""What the divergence step kills of engine 0: its worker rank, whose restart (model load, the
core's recovery: ~5 s) leaves the longest outage; the core-fault step kills the engine core."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scaleout", description=__doc__)
    p.add_argument("--model", default="", help="default: the default model (SmolLM2-135M)")
    p.add_argument("--shape", default="scaled", choices=sorted(SHAPES),
                   help="scaled: SP-MT-8 (2 cores); full: SP-MT-16 (with --rate 1 "
                        "--rates 0.25,0.5,1,2,4,8, for a bigger machine)")  # fmt: skip
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rate", type=float, default=1.4, help="reference arrival rate, req/s")
    p.add_argument("--rates", default="0.7,1,1.4,2,2.8,4,5.6", help="the sweep, req/s")
    p.add_argument("--control-rate", type=float, default=8.0,
                   help="the control's arrivals, req/s (above the sustained rate)")  # fmt: skip
    p.add_argument(
        "--variants", default=DEFAULT_VARIANTS, help=f"comma-separated, of {list(VARIANTS)}"
    )
    p.add_argument("--skip", default="", help="steps not to run (comma-separated, of sweep, "
                   "control, divergence, core-fault, routing): a shorter smoke")  # fmt: skip
    p.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON), help="the vLLM venv's python")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--report", action="store_true",
                   help=f"print the tables of {RESULTS} again; run nothing")  # fmt: skip
    return p


def flush_caches(engines: Sequence[str]) -> None:
    """Every engine's prefix cache emptied (VllmEngine/FlushCache, waiting until idle); a
    gateway fed by KV events forgets them too (AllBlocksCleared)."""
    for addr in engines:
        with grpc.insecure_channel(addr) as channel:
            stub = pb_grpc.VllmEngineStub(channel)
            reply = stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=120), timeout=130)
            if not reply.success:
                raise RuntimeError(f"FlushCache on {addr}: {reply.message}")


@dataclass
class Bench:
    """What every step of one variant's round needs."""

    args: argparse.Namespace
    shape: Shape
    words: list[str]
    encode: Encode
    target: Target
    model: str
    round_index: int

    def seed(self, step: int) -> int:
        return 1000 * self.round_index + step

    def measure(self, workload: Workload, rate: float, flush: bool = True) -> RunStats:
        if flush:
            flush_caches(self.target.engines)
        names = (PREFIX_QUERIES, PREFIX_HITS)
        before = counters(self.target.metrics_urls, names)
        url = f"http://{self.target.http}"
        results, wall_s = asyncio.run(run_sessions(url, self.model, workload))
        after = counters(self.target.metrics_urls, names)
        stats = run_stats(rate, results, wall_s, before, after)
        print(f"    {workload.name} at {rate:g} req/s: {stats}", flush=True)
        return stats


def step_sweep(b: Bench, reference: RunStats) -> list[dict[str, Any]]:
    rates = sorted({float(r) for r in b.args.rates.split(",")} | {b.args.rate})

    def at(rate: float) -> RunStats:
        if rate == b.args.rate:
            return reference
        shape = below_reference(b.shape, rate / b.args.rate)
        return b.measure(sp_mt(b.words, rate, b.seed(rates.index(rate)), shape), rate)

    return [asdict(s) for s in run_sweep(rates, b.args.rate, at)]


def below_reference(shape: Shape, share: float) -> Shape:
    """A sweep point below the reference rate (`share` of it) with that share of the sessions
    per group (at least 2; every group kept): its arrivals span as long as the reference run's
    instead of 1 / share times as long."""
    if share >= 1:
        return shape
    sessions = max(2, round(shape.sessions_per_group * share))
    return dataclasses.replace(shape, sessions_per_group=sessions)


def run_sweep(
    rates: Sequence[float], reference: float, at: Callable[[float], RunStats]
) -> list[RunStats]:
    """The rates from the reference one up while TTFT p90 holds; where the reference rate is not
    sustained, the rates below it, downward, until one is (ascending by rate)."""
    sweep: list[RunStats] = []
    for rate in (r for r in rates if r >= reference):
        sweep.append(at(rate))
        if not sweep[-1].is_sustained:
            break
    if not sweep or not sweep[0].is_sustained:
        for rate in sorted((r for r in rates if r < reference), reverse=True):
            sweep.append(at(rate))
            if sweep[-1].is_sustained:
                break
    return sorted(sweep, key=lambda s: s.rate)


def step_control(b: Bench) -> dict[str, Any]:
    rate = b.args.control_rate
    workload = no_sharing(b.words, rate, b.seed(998), b.shape, b.shape.num_sessions)
    return asdict(b.measure(workload, rate))


def step_divergence(b: Bench, earlier: Workload) -> dict[str, Any]:
    """Engine 0 restarted empty while returning sessions of `earlier` arrive; then more."""
    assert b.target.serve is not None
    outage = returning(b.words, earlier, OUTAGE_RATE, b.seed(996), b.shape)
    _, _, fault = run_with_fault(b.target, b.model, outage, 0, DIVERGENCE_FAULT, 0.5)
    wait_routable(b.target.http, len(b.target.engines))
    after = returning(b.words, earlier, b.args.rate, b.seed(997), b.shape)
    return {"fault": asdict(fault), "returning": asdict(b.measure(after, b.args.rate, False))}


def step_core_fault(b: Bench) -> dict[str, Any]:
    flush_caches(b.target.engines)
    workload = no_sharing(b.words, b.args.rate, b.seed(995), b.shape, b.shape.num_sessions)
    _, _, fault = run_with_fault(b.target, b.model, workload, 0, "core", 3.0)
    return asdict(fault)


def step_routing(b: Bench) -> dict[str, Any]:
    assert b.target.serve is not None
    cost = routing_cost(b.target.http, b.target.serve.engine_http[0], b.model, b.words)
    return {**asdict(cost), "added_p50_ms": cost.added_p50_ms, "added_p99_ms": cost.added_p99_ms}


def run_steps(b: Bench, variant: str) -> dict[str, Any]:
    workload = sp_mt(b.words, b.args.rate, b.seed(0), b.shape)
    reference = b.measure(workload, b.args.rate)
    run: dict[str, Any] = {"reference": asdict(reference)}
    run["oracle_hit_rate"] = oracle_hit_rate(workload, b.encode)
    skip = set(b.args.skip.split(","))
    for step in (s for s in STEPS.get(variant, ()) if s not in skip):
        if step == "divergence":  # first: the caches hold the reference run's sessions
            run[step] = step_divergence(b, workload)
        elif step == "sweep":
            run[step] = step_sweep(b, reference)
        elif step == "control":
            run[step] = step_control(b)
        elif step == "core-fault":
            run[step] = step_core_fault(b)
        elif step == "routing":
            run[step] = step_routing(b)
    return run


def start_target(
    args: argparse.Namespace, variant: str, model_dir: Path, kv_bytes: int, round_index: int
) -> Target:
    router, extra = VARIANTS[variant]
    flags = ["--dtype", args.dtype, "--max-model-len", str(args.shape_.max_model_len)]
    flags += ["--kv-cache-memory-bytes", str(kv_bytes)]
    logs = BENCH_DIR / "scaleout-logs" / f"round{round_index}-{variant.replace(':', '-')}"
    if variant.startswith("vllm:"):
        return vllm_target(args.vllm_python, str(model_dir), router, flags, args.engines, logs,
                           args.startup_timeout)  # fmt: skip
    flags += [*extra, "--torch-threads", str(args.threads)]
    return splitserve_target(args.model, router, flags, args.engines, logs.with_suffix(".log"),
                             args.startup_timeout)  # fmt: skip


def run_variant(
    args: argparse.Namespace,
    variant: str,
    setup: dict[str, Any],
    round_index: int,
    target: Target | None = None,
) -> tuple[dict[str, Any], Target]:
    """One variant's steps, on `target` (the same variant's, kept from the round before) or on
    a fresh stack; the stack is left running for the caller."""
    if target is None:
        target = start_target(args, variant, setup["model_dir"], setup["kv_bytes"], round_index)
    try:
        client = openai.OpenAI(base_url=f"http://{target.http}/v1", api_key="-")
        model = client.models.list().data[0].id
        bench = Bench(args, args.shape_, setup["words"], setup["encode"], target, model,
                      round_index)  # fmt: skip
        return run_steps(bench, variant), target
    except BaseException:
        target.stop()
        raise


def schedule(variants: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """(round, variant) in the order they run: variants alternate their order round by round
    (ABC, CBA, ABC), so a round's last variant is the next round's first (its stack is kept)."""
    return [(r, v) for r in range(rounds) for v in (variants if r % 2 == 0 else variants[::-1])]


def run_all(
    args: argparse.Namespace, setup: dict[str, Any], order: Sequence[tuple[int, str]]
) -> list[dict[str, Any]]:
    """Every (round, variant) of `order`, each run saved to RESULTS as it ends."""
    runs: list[dict[str, Any]] = []
    kept: Target | None = None
    try:
        for i, (round_index, variant) in enumerate(order):
            print(f"round {round_index + 1}: {variant}", flush=True)
            try:
                run, kept = run_variant(args, variant, setup, round_index, kept)
            except (ServerError, TimeoutError) as err:
                if not variant.startswith("vllm:"):
                    raise
                print(f"    the vLLM anchor did not start: {err}", flush=True)  # say why, go on
                runs.append({"round": round_index, "variant": variant, "error": str(err)})
                kept = None
                continue
            if i + 1 == len(order) or order[i + 1][1] != variant:
                kept.stop()
                kept = None
            runs.append({"round": round_index, "variant": variant, **run})
            saved = {k: v for k, v in vars(args).items() if k != "shape_"}
            out = {"args": saved, "kv_tokens_per_engine": setup["kv_tokens"], "runs": runs}
            RESULTS.write_text(json.dumps(out, indent=1))
    finally:
        if kept is not None:
            kept.stop()
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.shape_ = SHAPES[args.shape]
    if args.report:
        saved = json.loads(RESULTS.read_text())
        shape, rate = SHAPES[saved["args"]["shape"]], saved["args"]["rate"]
        print(render(saved["runs"], shape, rate))
        return 0
    # `kill PID` stops the stack under test too (SystemExit runs run_all's `finally`).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    setup = prepare(args)
    variants = args.variants.split(",")
    if not Path(args.vllm_python).exists():
        print(f"{args.vllm_python} is missing (make bench-peer builds it): no vLLM anchor")
        variants = [v for v in variants if not v.startswith("vllm:")]
    BENCH_DIR.mkdir(exist_ok=True)
    runs = run_all(args, setup, schedule(variants, args.rounds))
    print(render(runs, args.shape_, args.rate))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`python -m benchmarks.flag_ab [--rounds N] -- FLAGS`: what engine flags buy, A/B in one run.

Starts two splitserve stacks on the benchmark checkpoint, one plain and one with FLAGS (e.g.
`--async-scheduling`), both up at once, and alternates W2 (1 x 256 in, 128 out) and W1 (32 x 256
in, 64 out) between them for N rounds, so a busy machine's drift hits both sides alike. Per round
and workload it prints the client's TPOT and output tok/s beside the worker's own step
(`splitserve_worker_step_seconds`); then the best of the rounds, and for W2 the median of TPOT
minus the worker's step (the time between steps the client sees). Run it with
`OMP_NUM_THREADS=1` on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from benchmarks.bench_model import VOCAB_SIZE, ensure_bench_model
from benchmarks.hops import W1, W2, per_step_ms, scrape
from benchmarks.serve_compare import stack_options
from splitserve.children import Child, start_children, stop_children, wait_ready
from splitserve_client.bench_serve import (
    GenerateFn,
    Workload,
    grpc_generate,
    run_workload,
    summarize,
)

BASE_FLAGS = ["--dtype", "bfloat16", "--max-num-seqs", "64"]
Row = dict[str, float | int | str]


@dataclass
class _Stack:
    children: list[Child]
    generate: GenerateFn
    close: Callable[[], Awaitable[None]]


def cpu_seconds(children: Sequence[Child]) -> float:
    """CPU time (user + system) the stack's processes used so far: less sensitive than
    throughput to other work on a shared machine."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for child in children:
        with open(f"/proc/{child.process.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


async def _round(name: str, workload: Workload, stack: _Stack) -> Row:
    children = stack.children
    before = await asyncio.to_thread(scrape, children)
    cpu_before = cpu_seconds(children)
    summary = summarize(*await run_workload(stack.generate, workload, progress=False))
    cpu_used = cpu_seconds(children) - cpu_before
    after = await asyncio.to_thread(scrape, children)
    return {
        "side": name,
        "tpot_ms": round(summary["mean_tpot_ms"], 3),
        "tok_s": round(summary["output_throughput"], 1),
        "worker_step_ms": round(per_step_ms(before, after).get("worker_total_ms", 0.0), 3),
        "cpu_s": round(cpu_used, 2),
    }


async def run(
    flags: list[str],
    rounds: int,
    services: Sequence[str] = ("core",),
    workloads: Sequence[str] = ("W2", "W1"),
) -> dict[str, list[Row]]:
    """Both stacks' rows per workload; FLAGS go to each service in `services`."""
    model = str(ensure_bench_model(None))
    started: list[list[Child]] = []
    stacks: dict[str, _Stack] = {}
    rows: dict[str, list[Row]] = {name: [] for name in workloads}
    try:
        for name, extra in (("plain", []), ("flags", flags)):
            options = stack_options(model, [*BASE_FLAGS, *(extra if "core" in services else [])])
            service_flags = {**options.service_flags}
            for kind in set(services) - {"core"}:
                service_flags[kind] = [*service_flags.get(kind, []), *extra]
            options = dataclasses.replace(options, service_flags=service_flags)
            children = start_children(options)
            started.append(children)
            await asyncio.to_thread(wait_ready, children, 600.0)
            stacks[name] = _Stack(children, *grpc_generate(children[-1].address))
            warm_up = Workload(2, 32, 8, vocab_size=VOCAB_SIZE)
            await run_workload(stacks[name].generate, warm_up, progress=False)
        for i in range(rounds):
            for workload_name, workload in (("W2", W2), ("W1", W1)):
                if workload_name not in rows:
                    continue
                for name, stack in stacks.items():
                    row = await _round(name, workload, stack)
                    rows[workload_name].append(row)
                    print(json.dumps({"round": i, "workload": workload_name, **row}), flush=True)
    finally:
        for stack in stacks.values():
            await stack.close()
        for children in started:
            await asyncio.to_thread(stop_children, children)
    return rows


def report(rows: dict[str, list[Row]]) -> None:
    print("\n| workload | side | best TPOT ms | best tok/s | median TPOT - worker step ms |")
    print("|---|---|---:|---:|---:|")
    for workload_name, workload_rows in rows.items():
        for side in ("plain", "flags"):
            mine = [r for r in workload_rows if r["side"] == side]
            gaps = [float(r["tpot_ms"]) - float(r["worker_step_ms"]) for r in mine]
            best_tpot = min(float(r["tpot_ms"]) for r in mine)
            best_tok_s = max(float(r["tok_s"]) for r in mine)
            # W1's mean step also counts its prefills, which TPOT leaves out: no gap there.
            gap = f"{statistics.median(gaps):.2f}" if workload_name == "W2" else "-"
            print(f"| {workload_name} | {side} | {best_tpot:.2f} | {best_tok_s:.1f} | {gap} |")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("flags", nargs="+", help="the engine flags to measure (after --)")
    args = parser.parse_args(argv)
    report(asyncio.run(run(args.flags, args.rounds)))


if __name__ == "__main__":
    main()

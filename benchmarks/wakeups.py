"""`python -m benchmarks.wakeups [-- ENGINE FLAGS]`: what each process of a served stack costs per
generated token, thread by thread.

Starts the stack (worker, core, frontend) on the benchmark checkpoint, runs W2 (1 x 256 in, 128
out) through the public gRPC API and reads /proc before and after (and over 5 s idle before it):
per process and per thread name, context switches per output token (voluntary: the thread slept and was woken, a wake-up;
involuntary: it was preempted) and CPU milliseconds per output token. A worker's forward slows
when the core's and frontend's threads wake on its cores between its OpenMP barriers; these are
the counts to drive down (issue 26). Wall-clock numbers need a quiet machine; these do not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Sequence
from pathlib import Path

from benchmarks.bench_model import VOCAB_SIZE
from benchmarks.hops import on_bench_stack
from splitserve.children import Child
from splitserve_client.bench_serve import Workload, grpc_generate, run_workload

W2 = Workload(num_prompts=1, input_len=256, output_len=128, vocab_size=VOCAB_SIZE, seed=1)
TICKS = os.sysconf("SC_CLK_TCK")
IDLE_SECONDS = 5.0
"""How long the stack is watched idle, before the workload."""

KEYS = ("threads", "voluntary", "involuntary", "cpu_ms")
COLUMNS = ("voluntary", "net", "idle_per_s", "involuntary", "cpu_ms")
Counts = dict[str, dict[str, float]]
"""Thread name -> {"voluntary", "involuntary", "cpu_ms"} summed over its threads."""


def thread_counts(pid: int) -> Counts:
    """Every live thread of `pid`, grouped by name (threads that ended are not counted)."""
    counts: Counts = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
            stat = (task / "stat").read_text()
        except OSError:
            continue  # it ended meanwhile
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        utime, stime = stat.rsplit(")", 1)[1].split()[11:13]
        row = counts.setdefault(fields["Name"].strip(), dict.fromkeys(KEYS, 0.0))
        row["threads"] += 1
        row["voluntary"] += int(fields["voluntary_ctxt_switches"])
        row["involuntary"] += int(fields["nonvoluntary_ctxt_switches"])
        row["cpu_ms"] += 1e3 * (int(utime) + int(stime)) / TICKS
    return counts


def per_token(
    before: Counts, after: Counts, num_tokens: int, idle: Counts, seconds: float
) -> dict[str, dict[str, float]]:
    """Per output token over the workload, and `idle_per_s`: the same threads' wake-ups per
    second when idle (timers, pollers), which a slower step adds per token without doing
    anything per token; `net` is the wake-ups per token less that idle rate."""
    rows = {}
    zero = dict.fromkeys(KEYS, 0.0)
    for name, row in after.items():
        prior = before.get(name, zero)
        delta = {k: (row[k] - prior[k]) / num_tokens for k in KEYS[1:]}
        if any(delta.values()):
            idle_per_s = idle.get(name, zero)["voluntary"] / IDLE_SECONDS
            net = delta["voluntary"] - idle_per_s * seconds / num_tokens
            rows[name] = {"threads": row["threads"], **delta, "idle_per_s": idle_per_s, "net": net}
    return rows


def difference(before: Counts, after: Counts) -> Counts:
    zero = dict.fromkeys(KEYS, 0.0)
    return {n: {k: r[k] - before.get(n, zero)[k] for k in KEYS} for n, r in after.items()}


def snapshot(children: Sequence[Child]) -> dict[str, Counts]:
    return {child.name: thread_counts(child.process.pid) for child in children}


async def measure(children: Sequence[Child]) -> dict[str, dict[str, dict[str, float]]]:
    generate, close = grpc_generate(children[-1].address)
    try:
        await run_workload(generate, Workload(2, 32, 8, vocab_size=VOCAB_SIZE), progress=False)
        quiet = snapshot(children)
        await asyncio.sleep(IDLE_SECONDS)
        before = snapshot(children)
        idle = {name: difference(quiet[name], before[name]) for name in before}
        results, seconds = await run_workload(generate, W2, progress=False)
        after = snapshot(children)
        num_tokens = sum(r.num_tokens for r in results)
        return {
            name: per_token(before[name], after[name], num_tokens, idle[name], seconds)
            for name in after
        }
    finally:
        await close()


async def run(flags: list[str]) -> dict[str, dict[str, dict[str, float]]]:
    return await on_bench_stack(flags, measure)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("flags", nargs="*", help="more engine flags (after --)")
    result = asyncio.run(run(parser.parse_args(argv).flags))
    print(
        "| process | thread | threads | wake-ups/token | less idle rate | idle wake-ups/s "
        "| preempted/token | CPU ms/token |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for process, rows in result.items():
        total = dict.fromkeys(("threads", *COLUMNS), 0.0)
        for name, row in sorted(rows.items(), key=lambda item: -item[1]["voluntary"]):
            total = {k: total[k] + row[k] for k in total}
            print(f"| {process} | {name} | {_cells(row)} |")
        print(f"| {process} | **all** | {_cells(total)} |")
    print(json.dumps(result))


def _cells(row: dict[str, float]) -> str:
    return " | ".join([f"{row['threads']:.0f}", *(f"{row[k]:.2f}" for k in COLUMNS)])


if __name__ == "__main__":
    main()

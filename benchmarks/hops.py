"""`python -m benchmarks.hops`: where the time between two tokens goes, hop by hop.

Starts the splitserve stack (worker, core, frontend processes) on the benchmark checkpoint,
runs W2 (1 x 256 in, 128 out) and W1 (32 x 256 in, 64 out) through the public gRPC API, and
reads the services' own `splitserve_*` histograms before and after each workload. Per engine
step (means over the workload):

* worker: `splitserve_worker_step_seconds` by phase (prepare_inputs, forward, sample, total);
* core -> worker -> core: `splitserve_core_worker_rtt_seconds`, and its part outside the
  worker's own step, `splitserve_core_worker_hop_seconds` (serialisation, gRPC, transport);
* core: `splitserve_core_step_seconds` (schedule + round trip + update), so core step minus
  round trip is the core's own bookkeeping;
* core -> frontend: `splitserve_core_output_send_seconds` (per message),
  `splitserve_frontend_output_processing_seconds` (detokenize, stops, deltas, per message);

beside the client's TPOT (W2) or its mean inter-token time (W1). Prints one JSON line per
workload and a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.bench_model import VOCAB_SIZE, ensure_bench_model
from benchmarks.serve_compare import stack_options
from splitserve.children import Child, start_children, stop_children, wait_ready
from splitserve_client.bench_serve import Workload, grpc_generate, run_workload, summarize

_T = TypeVar("_T")

W1 = Workload(num_prompts=32, input_len=256, output_len=64, vocab_size=VOCAB_SIZE)
W2 = Workload(num_prompts=1, input_len=256, output_len=128, vocab_size=VOCAB_SIZE, seed=1)

HOPS = {
    "worker_prepare_ms": ("splitserve_worker_step_seconds", {"phase": "prepare_inputs"}),
    "worker_forward_ms": ("splitserve_worker_step_seconds", {"phase": "forward"}),
    "worker_sample_ms": ("splitserve_worker_step_seconds", {"phase": "sample"}),
    "worker_total_ms": ("splitserve_worker_step_seconds", {"phase": "total"}),
    "core_worker_rtt_ms": ("splitserve_core_worker_rtt_seconds", {}),
    "core_worker_hop_ms": ("splitserve_core_worker_hop_seconds", {}),
    "core_step_ms": ("splitserve_core_step_seconds", {}),
    "core_output_send_ms": ("splitserve_core_output_send_seconds", {}),
    "frontend_output_processing_ms": ("splitserve_frontend_output_processing_seconds", {}),
}
"""Reported name -> (histogram, labels it must carry)."""

Totals = dict[str, tuple[float, float]]
"""Reported name -> (sum of seconds, count) of its histogram at one moment."""


def histogram_totals(metrics_text: str) -> Totals:
    """(sum, count) of every HOPS histogram found in one Prometheus exposition."""
    totals: Totals = {}
    for family in text_string_to_metric_families(metrics_text):
        for name, (histogram, labels) in HOPS.items():
            if family.name != histogram:
                continue
            parts = {"_sum": 0.0, "_count": 0.0}
            for sample in family.samples:
                suffix = sample.name[len(histogram) :]
                if suffix in parts and labels.items() <= sample.labels.items():
                    parts[suffix] += sample.value
            if parts["_count"]:
                totals[name] = (parts["_sum"], parts["_count"])
    return totals


def per_step_ms(before: Totals, after: Totals) -> dict[str, float]:
    """Mean milliseconds per observation between two scrapes, for what was observed between."""
    means = {}
    for name, (total, count) in after.items():
        prior_total, prior_count = before.get(name, (0.0, 0.0))
        if count > prior_count:
            means[name] = 1e3 * (total - prior_total) / (count - prior_count)
    return means


def scrape(children: Sequence[Child]) -> Totals:
    totals: Totals = {}
    for child in children:
        with urllib.request.urlopen(child.metrics_url, timeout=10) as response:  # noqa: S310
            totals.update(histogram_totals(response.read().decode()))
    return totals


async def measure(children: Sequence[Child]) -> dict[str, dict[str, float]]:
    generate, close = grpc_generate(children[-1].address)
    try:
        await run_workload(generate, Workload(2, 32, 8, vocab_size=VOCAB_SIZE), progress=False)
        rows = {}
        for name, workload in (("W2", W2), ("W1", W1)):
            before = await asyncio.to_thread(scrape, children)
            summary = summarize(*await run_workload(generate, workload, progress=False))
            after = await asyncio.to_thread(scrape, children)
            rows[name] = {"client_tpot_ms": summary["mean_tpot_ms"]} | per_step_ms(before, after)
        return rows
    finally:
        await close()


async def on_bench_stack(flags: list[str], measure: Callable[[list[Child]], Awaitable[_T]]) -> _T:
    """`measure` run on a fresh stack (the benchmark checkpoint, bf16, `flags` added)."""
    core_flags = ["--dtype", "bfloat16", "--max-num-seqs", "64", *flags]
    children = start_children(stack_options(str(ensure_bench_model(None)), core_flags))
    try:
        await asyncio.to_thread(wait_ready, children, 600.0)
        return await measure(children)
    finally:
        await asyncio.to_thread(stop_children, children)


async def run(flags: list[str]) -> dict[str, dict[str, float]]:
    return await on_bench_stack(flags, measure)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("flags", nargs="*", help="more engine flags (after --)")
    rows = asyncio.run(run(parser.parse_args(argv).flags))
    for name, row in rows.items():
        print(json.dumps({"workload": name} | {k: round(v, 3) for k, v in row.items()}))
    print(f"\n| per step, ms | {' | '.join(rows)} |\n|---|{'---:|' * len(rows)}")
    for key in ["client_tpot_ms", *HOPS]:
        cells = [f"{row[key]:.2f}" if key in row else "" for row in rows.values()]
        print(f"| {key.removesuffix('_ms')} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()

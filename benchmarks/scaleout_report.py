"""The scale-out benchmark's tables (benchmarks/scaleout.py), from its runs (one dict per variant
and round, as saved in .bench/scaleout-results.json): medians over rounds, each round's value in
parentheses, ratios against round_robin's median in brackets; then the issue's targets, each
with its figure and whether it is met."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.scaleout_client import RunStats
from benchmarks.scaleout_workload import Shape

Run = dict[str, Any]
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("hit_rate", "token hit rate", "{:.1%}"),
    ("ttft_p50_s", "TTFT p50 s", "{:.2f}"),
    ("ttft_p90_s", "TTFT p90 s", "{:.2f}"),
    ("output_tok_s", "output tok/s", "{:.1f}"),
    ("max_rate", "max rate, p90 <= 2 s", "{:g}"),
    ("control_tok_s", "no-sharing tok/s", "{:.1f}"),
)


def headline(run: Run) -> dict[str, float]:
    """One run's figures: the reference rate's, the highest sustained rate, the control's."""
    ref = run["reference"]
    sweep = run.get("sweep")
    sustained = [s["rate"] for s in sweep or () if RunStats(**s).is_sustained]
    return {
        **{k: ref[k] for k in ("hit_rate", "ttft_p50_s", "ttft_p90_s", "output_tok_s")},
        "max_rate": max(sustained, default=0.0) if sweep else math.nan,
        "control_tok_s": run["control"]["output_tok_s"] if run.get("control") else math.nan,
        "oracle_hit_rate": run.get("oracle_hit_rate", math.nan),
    }


def _median(values: Sequence[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def _cell(values: Sequence[float], fmt: str, base: float | None) -> str:
    median = _median(values)
    if math.isnan(median):
        return "–"
    cell = fmt.format(median)
    if len(values) > 1:
        cell += " (" + " / ".join(fmt.format(v) for v in values) + ")"
    if base:
        cell += f" [{median / base:.2f}x]"
    return cell


def by_variant(runs: Sequence[Run]) -> dict[str, list[Run]]:
    grouped: dict[str, list[Run]] = {}
    for run in runs:
        if "error" not in run:
            grouped.setdefault(run["variant"], []).append(run)
    return grouped


def main_table(grouped: dict[str, list[Run]], shape: Shape, rate: float) -> str:
    rows = {v: [headline(r) for r in runs] for v, runs in grouped.items()}
    base = {k: _median([r[k] for r in rows.get("round_robin", [])]) for k, _, _ in COLUMNS}
    oracle = _median([r["oracle_hit_rate"] for rs in rows.values() for r in rs])
    lines = [f"{shape.name} at {rate:g} req/s; ideal hit rate {shape.ideal_hit_rate():.1%}, "
             f"oracle (one infinite cache, 16-token blocks, the prompts sent) {oracle:.1%}",
             "| variant | " + " | ".join(label for _, label, _ in COLUMNS) + " |",
             "|---|" + "---:|" * len(COLUMNS)]  # fmt: skip
    for variant, values in rows.items():
        cells = []
        for key, _, fmt in COLUMNS:
            ratio_base = (
                base[key] if variant != "round_robin" and not math.isnan(base[key]) else None
            )
            cells.append(_cell([v[key] for v in values], fmt, ratio_base))
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def divergence_table(grouped: dict[str, list[Run]]) -> str:
    lines = ["Divergence: returning sessions after engine 0 restarted empty",
             "| variant | token hit rate | TTFT p50 s | TTFT p90 s |",
             "|---|---:|---:|---:|"]  # fmt: skip
    for variant, runs in grouped.items():
        rows = [r["divergence"]["returning"] for r in runs if r.get("divergence")]
        if rows:
            cells = [_cell([row[k] for row in rows], fmt, None)
                     for k, fmt in (("hit_rate", "{:.1%}"), ("ttft_p50_s", "{:.2f}"),
                                    ("ttft_p90_s", "{:.2f}"))]  # fmt: skip
            lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def faults(grouped: dict[str, list[Run]]) -> list[tuple[str, dict[str, Any]]]:
    """(variant, fault stats) of every lost-engine case of every round."""
    found = []
    for variant, runs in grouped.items():
        for run in runs:
            if run.get("divergence"):
                found.append((variant, run["divergence"]["fault"]))
            if run.get("core-fault"):
                found.append((variant, run["core-fault"]))
    return found


def faults_table(grouped: dict[str, list[Run]]) -> str:
    lines = ["An engine lost under load (engine 0's process SIGKILLed; sums over rounds)",
             "| variant | killed | running at the kill | complete | error | truncated | hung "
             "| serving again s (rounds) | KV usage after |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|"]  # fmt: skip
    cases: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for variant, fault in faults(grouped):
        cases.setdefault((variant, fault["fault"]), []).append(fault)
    for (variant, kind), rows in cases.items():
        counts = [
            sum(r["outcomes"][o] for r in rows) for o in ("complete", "error", "truncated", "hung")
        ]
        back = " / ".join(f"{r['serving_again_s']:.1f}" for r in rows)
        lines.append(f"| {variant} | {kind} | {sum(r['running_at_kill'] for r in rows):.0f} | "
                     + " | ".join(str(c) for c in counts)
                     + f" | {back} | {max(r['kv_usage_after'] for r in rows):.3f} |")  # fmt: skip
    return "\n".join(lines)


def routing_table(grouped: dict[str, list[Run]]) -> str:
    rows = [r["routing"] for runs in grouped.values() for r in runs if r.get("routing")]
    keys = ("direct_p50_ms", "direct_p99_ms", "gateway_p50_ms", "gateway_p99_ms",
            "added_p50_ms", "added_p99_ms")  # fmt: skip
    header = " | ".join(k.removesuffix("_ms").replace("_", " ") + " ms" for k in keys)
    lines = ["Routing's cost: one-token completions, direct to engine 0 vs through the gateway",
             f"| {header} |", "|" + "---:|" * len(keys)]  # fmt: skip
    if rows:
        lines.append(
            "| " + " | ".join(_cell([r[k] for r in rows], "{:.2f}", None) for k in keys) + " |"
        )
    return "\n".join(lines)


EV, RR, NOEV, VLLM = (
    "cache_aware+events",
    "round_robin",
    "cache_aware-no-events",
    "vllm:cache_aware+events",
)


class Figures:
    """The medians over rounds that the targets compare."""

    def __init__(self, grouped: dict[str, list[Run]]) -> None:
        self.grouped = grouped

    def median(self, variant: str, pick: Callable[[Run], float]) -> float:
        return _median([pick(r) for r in self.grouped.get(variant, [])])

    def h(self, variant: str, key: str) -> float:
        return self.median(variant, lambda r: headline(r)[key])

    def ratio(self, key: str, base: str = RR) -> float:
        below = self.h(base, key)
        return self.h(EV, key) / below if below else math.nan

    def divergence_gain(self) -> float:
        def hit(r: Run) -> float:
            return r["divergence"]["returning"]["hit_rate"] if r.get("divergence") else math.nan

        return self.median(EV, hit) - self.median(NOEV, hit)

    def routing_added_p50(self) -> float:
        return _median([r["routing"]["added_p50_ms"] for r in self.grouped.get(EV, [])
                        if r.get("routing")])  # fmt: skip

    def lost_silently(self) -> float:
        lost = [f["outcomes"] for _, f in faults(self.grouped)]
        return float(sum(o["hung"] + o["truncated"] for o in lost)) if lost else math.nan


def targets(grouped: dict[str, list[Run]]) -> str:
    f = Figures(grouped)
    checks: list[tuple[str, float, Callable[[float], bool], str]] = [
        ("hit rate with events >= 80 %", f.h(EV, "hit_rate"), lambda x: x >= 0.8, "{:.1%}"),
        ("round-robin hit rate <= 35 %", f.h(RR, "hit_rate"), lambda x: x <= 0.35, "{:.1%}"),
        ("TTFT p50 <= 0.25x round-robin", f.ratio("ttft_p50_s"), lambda x: x <= 0.25, "{:.2f}x"),
        ("TTFT p90 <= 0.2x round-robin", f.ratio("ttft_p90_s"), lambda x: x <= 0.2, "{:.2f}x"),
        ("sustainable rate >= 2x round-robin", f.ratio("max_rate"), lambda x: x >= 2, "{:.2f}x"),
        ("no-sharing control within 5 % of round-robin", f.ratio("control_tok_s"),
         lambda x: abs(x - 1) <= 0.05, "{:.3f}x"),
        ("event-fed beats event-less after a divergence", f.divergence_gain(),
         lambda x: x > 0, "{:+.1%} hit rate"),
        ("throughput >= 1.0x vLLM-CPU's", f.ratio("output_tok_s", VLLM),
         lambda x: x >= 1.0, "{:.3f}x"),
        ("TTFT p90 <= 1.0x vLLM-CPU's", f.ratio("ttft_p90_s", VLLM), lambda x: x <= 1.0, "{:.2f}x"),
        ("routing adds <= 1 ms p50", f.routing_added_p50(), lambda x: x <= 1.0, "{:.2f} ms"),
        ("lost engine: 0 hung, 0 truncated", f.lost_silently(), lambda x: x == 0, "{:.0f}"),
    ]  # fmt: skip
    lines = ["| target | figure | met |", "|---|---:|---|"]
    for name, value, ok, fmt in checks:
        met = "–" if math.isnan(value) else ("yes" if ok(value) else "no")
        lines.append(f"| {name} | {'–' if math.isnan(value) else fmt.format(value)} | {met} |")
    return "\n".join(lines)


def render(runs: Sequence[Run], shape: Shape, rate: float) -> str:
    grouped = by_variant(runs)
    parts = [main_table(grouped, shape, rate), divergence_table(grouped), faults_table(grouped),
             routing_table(grouped), targets(grouped)]  # fmt: skip
    return "\n\n".join(parts)

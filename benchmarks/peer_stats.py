"""Arithmetic of the side-by-side benchmark: percentiles, per-workload summaries, medians over
rounds, splitserve / vLLM ratios and the report table. Pure: no I/O, no clocks."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from splitserve_client.bench_serve import RequestResult


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), interpolated linearly between closest ranks (numpy's
    default, which `vllm bench serve` reports)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def itls(result: RequestResult) -> list[float]:
    return [b - a for a, b in zip(result.token_times, result.token_times[1:], strict=False)]


def summarize(results: Sequence[RequestResult], duration_s: float) -> dict[str, float]:
    """One workload run: throughput over the wall time, TTFT / TPOT / ITL in ms (the
    successful requests only; `failed` counts the others)."""
    ok = [r for r in results if not r.error]
    summary: dict[str, float] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "output_tokens": sum(r.num_tokens for r in ok),
        "output_tok_s": sum(r.num_tokens for r in ok) / duration_s,
    }
    if not ok:
        return summary
    ttfts = [r.ttft * 1e3 for r in ok]
    tpots = [t * 1e3 for r in ok if (t := r.tpot) is not None]
    gaps = [gap * 1e3 for r in ok for gap in itls(r)]
    summary |= {
        "ttft_mean_ms": statistics.fmean(ttfts),
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p99_ms": percentile(ttfts, 99),
    }
    if tpots:
        summary |= {"tpot_mean_ms": statistics.fmean(tpots), "tpot_p50_ms": percentile(tpots, 50)}
    if gaps:
        summary |= {"itl_p50_ms": percentile(gaps, 50), "itl_p99_ms": percentile(gaps, 99)}
    return summary


@dataclass(frozen=True)
class Metric:
    """One row of the report."""

    key: str
    label: str
    is_higher_better: bool


METRICS = (
    Metric("w1_output_tok_s", "W1: 32 x (256 in, 64 out) at once, output tok/s", True),
    Metric("w3_burst_output_tok_s", "W3-burst: the 64 at once, output tok/s", True),
    Metric("w2_ttft_ms", "W2: 1 x (256 in, 128 out), TTFT ms", False),
    Metric("w2_tpot_ms", "W2: 1 x (256 in, 128 out), TPOT ms", False),
    Metric("w3_ttft_p99_ms", "W3: 64 at Poisson 2 req/s, TTFT p99 ms", False),
    Metric("w3_itl_p99_ms", "W3: 64 at Poisson 2 req/s, ITL p99 ms", False),
    Metric("startup_s", "start-up to ready, s", False),
)


def round_metrics(
    startup_s: float,
    w1: Mapping[str, float],
    w2_runs: Sequence[Mapping[str, float]],
    w3: Mapping[str, float],
    w3_burst: Mapping[str, float],
) -> dict[str, float]:
    """The headline numbers of one server in one round (W2: medians over its repeats)."""
    return {
        "w1_output_tok_s": w1["output_tok_s"],
        "w3_burst_output_tok_s": w3_burst["output_tok_s"],
        "w2_ttft_ms": statistics.median(r["ttft_mean_ms"] for r in w2_runs),
        "w2_tpot_ms": statistics.median(r["tpot_mean_ms"] for r in w2_runs),
        "w3_ttft_p99_ms": w3["ttft_p99_ms"],
        "w3_itl_p99_ms": w3["itl_p99_ms"],
        "startup_s": startup_s,
    }


def medians(rounds: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Each metric's median over rounds."""
    return {m.key: statistics.median(r[m.key] for r in rounds) for m in METRICS}


def ratio(splitserve: float, vllm: float) -> float:
    """splitserve / vLLM: above 1 is better for a throughput, worse for a latency."""
    return splitserve / vllm if vllm else math.inf


def verdict(metric: Metric, splitserve_over_vllm: float) -> str:
    """Which system is ahead on this metric, in words."""
    if math.isclose(splitserve_over_vllm, 1.0, rel_tol=1e-9):
        return "even"
    is_splitserve_ahead = (splitserve_over_vllm > 1) == metric.is_higher_better
    if metric.is_higher_better:
        factor = splitserve_over_vllm if is_splitserve_ahead else 1 / splitserve_over_vllm
    else:
        factor = 1 / splitserve_over_vllm if is_splitserve_ahead else splitserve_over_vllm
    return f"{'splitserve' if is_splitserve_ahead else 'vLLM'} {factor:.2f}x better"


def _cell(median: float, per_round: Sequence[float]) -> str:
    digits = 2 if median < 10 else 1 if median < 100 else 0
    rounds = " / ".join(f"{v:.{digits}f}" for v in per_round)
    return f"**{median:.{digits}f}** ({rounds})" if len(per_round) > 1 else f"{median:.{digits}f}"


def render_table(
    splitserve_rounds: Sequence[Mapping[str, float]], vllm_rounds: Sequence[Mapping[str, float]]
) -> str:
    """A Markdown table: median (each round) per system, then splitserve / vLLM of the medians."""
    return render_systems_table({"splitserve": splitserve_rounds}, vllm_rounds)


def render_systems_table(
    ours: Mapping[str, Sequence[Mapping[str, float]]], vllm_rounds: Sequence[Mapping[str, float]]
) -> str:
    """One Markdown table for several splitserve configurations (name -> rounds) beside vLLM:
    each one's median (each round), then its ratio to vLLM's median and the verdict."""
    names = list(ours)
    only = len(names) == 1
    head = ["workload", *names, "vLLM"]
    head += ["splitserve / vLLM", "ahead"] if only else [f"{n} / vLLM" for n in names]
    lines = [
        "| " + " | ".join(head) + " |",
        "|---|" + "---:|" * (len(head) - 1 - only) + "---|" * only,
    ]
    theirs = medians(vllm_rounds)
    medians_of = {n: medians(rounds) for n, rounds in ours.items()}
    for m in METRICS:
        cells = [_cell(medians_of[n][m.key], [x[m.key] for x in ours[n]]) for n in names]
        cells.append(_cell(theirs[m.key], [x[m.key] for x in vllm_rounds]))
        ratios = [ratio(medians_of[n][m.key], theirs[m.key]) for n in names]
        if only:
            cells += [f"{ratios[0]:.2f}x", verdict(m, ratios[0])]
        else:
            cells += [f"{r:.2f}x {verdict(m, r)}" for r in ratios]
        lines.append(f"| {m.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)

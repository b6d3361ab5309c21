"""`python -m benchmarks.serve_compare`: one run, three ways, same workloads, same model.

1. transformers `generate` (fp32, the usual baseline): W1 as one batch, W2 alone;
2. the splitserve stack (worker, core, frontend processes; gRPC hops), loaded with the public
   API exactly as `splitserve bench serve` does;
3. the same engine in-process (benchmarks/inprocess.py): frontend, core and worker in one
   process behind the same public gRPC API, so only the internal hops differ.

Workloads (on the ~100M random Llama of benchmarks/bench_model.py, bf16 checkpoint, bf16
compute — the fastest dtype on these CPUs): W1 = 32 requests x 256 random prompt tokens x 64
output tokens, all at once, greedy, ignore_eos; W2 = 1 request x 256 x 128 (TTFT and TPOT).
Targets: W1 output throughput >= 1.5x transformers' fp32 batch; W2 TPOT <= 0.6x transformers';
the gRPC hops cost <= 5 % against the in-process run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from benchmarks.bench_model import VOCAB_SIZE, ensure_bench_model
from splitserve.children import StackOptions, start_children, stop_children, wait_ready
from splitserve.loopback_ports import free_ports
from splitserve_client.bench_serve import (
    GenerateFn,
    Workload,
    grpc_generate,
    run_workload,
    summarize,
    vocab_size_of,
)

W1 = Workload(num_prompts=32, input_len=256, output_len=64, vocab_size=VOCAB_SIZE)
W2 = Workload(num_prompts=1, input_len=256, output_len=128, vocab_size=VOCAB_SIZE, seed=1)
DTYPE, MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, KV_CACHE_BYTES = "bfloat16", 64, 8192, 1 << 30


def transformers_baseline(model: str) -> dict[str, float]:
    """W1 as one fp32 batch; W2's TTFT and TPOT with one fp32 request."""
    import torch
    from transformers import AutoModelForCausalLM

    from splitserve_client.bench_serve import random_prompts

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

    def run(prompts: list[list[int]], new_tokens: int) -> float:
        ids = torch.tensor(prompts)
        started = time.perf_counter()
        with torch.inference_mode():
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=2,
            )
        return time.perf_counter() - started

    run(random_prompts(W2)[:1], 4)  # warm-up
    w1_seconds = run(random_prompts(W1), W1.output_len)
    ttft = min(run(random_prompts(W2), 1) for _ in range(2))
    total = run(random_prompts(W2), W2.output_len)
    return {
        "w1_output_throughput": W1.num_prompts * W1.output_len / w1_seconds,
        "w2_ttft_ms": ttft * 1e3,
        "w2_tpot_ms": (total - ttft) / (W2.output_len - 1) * 1e3,
    }


W2_REPEATS = 5


async def measure(generate: GenerateFn) -> dict[str, float]:
    """W1 once; W2 W2_REPEATS times (one 128-token request is a short, noisy sample on a
    shared 2-core machine), reporting the run with the median TPOT."""
    await run_workload(generate, Workload(2, 32, 8, vocab_size=VOCAB_SIZE), progress=False)
    w1 = summarize(*await run_workload(generate, W1))
    w2_runs = [
        summarize(*await run_workload(generate, replace(W2, seed=W2.seed + i), progress=False))
        for i in range(W2_REPEATS)
    ]
    w2 = sorted(w2_runs, key=lambda r: r["mean_tpot_ms"])[W2_REPEATS // 2]
    assert not w1["failed"] and not any(r["failed"] for r in w2_runs)
    return {
        "w1_output_throughput": w1["output_throughput"],
        "w1_mean_ttft_ms": w1["mean_ttft_ms"],
        "w1_mean_tpot_ms": w1["mean_tpot_ms"],
        "w2_ttft_ms": w2["mean_ttft_ms"],
        "w2_tpot_ms": w2["mean_tpot_ms"],
        "w2_p99_itl_ms": w2["p99_itl_ms"],
        "w2_tpot_min_ms": min(r["mean_tpot_ms"] for r in w2_runs),
        "w2_tpot_max_ms": max(r["mean_tpot_ms"] for r in w2_runs),
    }


def stack_options(
    model: str, core_flags: Sequence[str], frontend_flags: Sequence[str] = (), http_port: int = -1
) -> StackOptions:
    """One worker, core and frontend on loopback (HTTP off unless `http_port`), with these
    core and frontend flags."""
    flags = {"core": list(core_flags), "frontend": list(frontend_flags)}
    return StackOptions(model, http_port=http_port, log_level="warning", service_flags=flags)


async def grpc_stack(model: str) -> dict[str, float]:
    flags = [
        "--dtype",
        DTYPE,
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--max-num-batched-tokens",
        str(MAX_NUM_BATCHED_TOKENS),
        "--kv-cache-memory-bytes",
        str(KV_CACHE_BYTES),
    ]
    children = start_children(stack_options(model, flags))
    try:
        await asyncio.to_thread(wait_ready, children, 600.0)
        generate, close = grpc_generate(children[-1].address)
        result = await measure(generate)
        await close()
        return result
    finally:
        await asyncio.to_thread(stop_children, children)


async def in_process(model: str) -> dict[str, float]:
    """The in-process engine behind the same public gRPC API, in its own process."""
    port = free_ports(1)[0]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "benchmarks.inprocess",
            "--model",
            model,
            "--port",
            str(port),
            "--dtype",
            DTYPE,
            "--max-num-seqs",
            str(MAX_NUM_SEQS),
            "--max-num-batched-tokens",
            str(MAX_NUM_BATCHED_TOKENS),
            "--kv-cache-memory-bytes",
            str(KV_CACHE_BYTES),
        ]
    )
    addr = f"127.0.0.1:{port}"
    try:
        await wait_serving(addr, server)
        generate, close = grpc_generate(addr)
        result = await measure(generate)
        await close()
        return result
    finally:
        server.terminate()
        server.wait(30)


async def wait_serving(addr: str, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the in-process server exited with {server.returncode}")
        try:
            await vocab_size_of(addr)
            return
        except Exception:  # not up yet
            await asyncio.sleep(0.5)
    raise TimeoutError(f"the in-process server at {addr} never answered")


def verdicts(
    hf: dict[str, float], grpc: dict[str, float], local: dict[str, float]
) -> dict[str, Any]:
    w1_ratio = grpc["w1_output_throughput"] / hf["w1_output_throughput"]
    w2_ratio = grpc["w2_tpot_ms"] / hf["w2_tpot_ms"]
    w1_hop = 1 - grpc["w1_output_throughput"] / local["w1_output_throughput"]
    w2_hop = grpc["w2_tpot_ms"] / local["w2_tpot_ms"] - 1
    return {
        "w1_vs_transformers": round(w1_ratio, 3),
        "w1_target_met": w1_ratio >= 1.5,
        "w2_tpot_vs_transformers": round(w2_ratio, 3),
        "w2_target_met": w2_ratio <= 0.6,
        "w1_hop_cost": round(w1_hop, 4),
        "w2_hop_cost": round(w2_hop, 4),
        "hop_target_met": max(w1_hop, w2_hop) <= 0.05,
    }


PHASES = {
    "transformers_fp32": lambda model: transformers_baseline(model),
    "splitserve_grpc": lambda model: asyncio.run(grpc_stack(model)),
    "splitserve_in_process": lambda model: asyncio.run(in_process(model)),
}


def run_phase(name: str) -> dict[str, float]:
    """Each phase in a fresh interpreter: torch thread pools from one run (e.g. transformers on
    the main thread) must not slow the next."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.serve_compare", "--phase", name],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    ).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def median_rows(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="alternating gRPC / in-process rounds (this machine's speed drifts; "
        "medians over interleaved rounds compare like with like)",
    )
    parser.add_argument("--phase", choices=sorted(PHASES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    model = str(ensure_bench_model())
    if args.phase:
        print(json.dumps(PHASES[args.phase](model)), flush=True)
        return 0
    rows: dict[str, dict[str, float]] = {}
    if not args.skip_transformers:
        rows["transformers_fp32"] = run_phase("transformers_fp32")
    rounds: dict[str, list[dict[str, float]]] = {"splitserve_grpc": [], "splitserve_in_process": []}
    for _ in range(args.rounds):
        for name, results in rounds.items():
            results.append(run_phase(name))
    rows |= {name: median_rows(results) for name, results in rounds.items()}
    for name, row in rows.items():
        print(json.dumps({"run": name, **{k: round(v, 2) for k, v in row.items()}}), flush=True)
    if "transformers_fp32" in rows:
        print(
            json.dumps(
                verdicts(
                    rows["transformers_fp32"],
                    rows["splitserve_grpc"],
                    rows["splitserve_in_process"],
                )
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`python -m benchmarks.worker`: step times of one worker rank on a ~100M-parameter Llama.

Builds a random Llama (hidden 768, 12 layers, 12 heads, 4 KV heads, intermediate 2048,
vocab 32000) once under the splitserve cache folder, then for each compute dtype reports, as
JSON lines:

* `copy_bandwidth`: a large tensor copy; bytes copied per second (read once, written once),
  measured before each dtype's runs;
* `decode`: one decode step for B requests with `context` tokens each in the KV cache,
  beside the memory-bandwidth floor: the weight bytes a step reads (all but the embedding
  table, of which it gathers a few rows) / copy bandwidth. A copy also writes every byte it
  reads, so a read-only weight stream can beat this floor by up to 2x;
* `prefill`: one step computing a 2048-token prompt;
* `serve_like`: 32 prompts of 256 tokens (4 prefill steps of 2048 tokens) and decode to 64
  output tokens each: output tokens per second over the whole run;
* `lora_load`, `lora_decode`: a rank-16 adapter's load time, and a batch-32 decode step mixing
  8 adapters against the base model's (benchmarks/worker_lora.py).

Times are medians over repeated steps, measured around `Worker.execute` (input preparation,
forward, sampling), after warm-up steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from benchmarks.bench_model import VOCAB_SIZE, ensure_bench_model
from benchmarks.worker_lora import bench_lora
from benchmarks.worker_steps import BLOCK_SIZE, Session, decode_cached
from splitserve_contracts.output_types import StepTimings
from worker_svc.layers.embedding import VocabParallelEmbedding
from worker_svc.model_loader.model_load import LoadModelConfig
from worker_svc.worker import Worker


def copy_bandwidth(num_bytes: int = 1 << 28, repeats: int = 10) -> float:
    """Bytes copied per second by a large tensor copy, best of `repeats` (each byte is read
    once and written once, so the memory traffic is twice this rate)."""
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - started)
    return num_bytes / min(times)


def bench_decode(session: Session, batch_size: int, context: int, steps: int) -> dict[str, float]:
    """B requests whose `context - 1` tokens are 'cached' (a prefix hit), then decode steps; a
    model with state layers computes the whole context first (a state has no prefix hits)."""
    rng = np.random.default_rng(batch_size)
    num_cached = 0 if session.num_state_slots else context - 1
    news = [
        session.new_request(rng.integers(3, VOCAB_SIZE, context), num_cached, steps + 4)
        for _ in range(batch_size)
    ]
    out, _ = session.execute(news, [context - num_cached] * batch_size)
    handles = [n.req_handle for n in news]
    times: list[float] = []
    parts: list[StepTimings] = []
    for i in range(steps + 2):
        cached = decode_cached(handles, [context + i] * batch_size, out.sampled_token_ids)
        out, elapsed = session.execute([], [1] * batch_size, cached)
        if i >= 2:  # warm-up
            times.append(elapsed)
            assert out.timings is not None
            parts.append(out.timings)
    session.execute([], [], finished=handles)
    return {
        "step_ms": 1e3 * statistics.median(times),
        "prepare_ms": 1e3 * statistics.median(p.prepare_inputs_seconds for p in parts),
        "forward_ms": 1e3 * statistics.median(p.forward_seconds for p in parts),
        "sample_ms": 1e3 * statistics.median(p.sample_seconds for p in parts),
    }


def bench_prefill(session: Session, num_tokens: int, repeats: int) -> float:
    rng = np.random.default_rng(0)
    times = []
    for _ in range(repeats + 1):
        new = session.new_request(rng.integers(3, VOCAB_SIZE, num_tokens), 0, 1)
        _, elapsed = session.execute([new], [num_tokens])
        session.execute([], [], finished=[new.req_handle])
        times.append(elapsed)
    return 1e3 * statistics.median(times[1:])


def bench_serve_like(
    session: Session, num_prompts: int, prompt_len: int, output_len: int, budget: int
) -> dict[str, float]:
    """Prefill in steps of `budget` tokens, then decode everyone to `output_len` tokens."""
    rng = np.random.default_rng(1)
    news = [
        session.new_request(rng.integers(3, VOCAB_SIZE, prompt_len), 0, output_len)
        for _ in range(num_prompts)
    ]
    per_step = budget // prompt_len
    started = time.perf_counter()
    last: dict[int, int] = {}
    for i in range(0, num_prompts, per_step):
        batch = news[i : i + per_step]
        out, _ = session.execute(batch, [prompt_len] * len(batch))
        last.update(zip(out.req_handles, out.sampled_token_ids, strict=True))
    handles = [n.req_handle for n in news]
    for i in range(output_len - 1):
        tokens = [last[h] for h in handles]
        cached = decode_cached(handles, [prompt_len + i] * num_prompts, tokens)
        out, _ = session.execute([], [1] * num_prompts, cached)
        last = dict(zip(out.req_handles, out.sampled_token_ids, strict=True))
    elapsed = time.perf_counter() - started
    session.execute([], [], finished=handles)
    return {"seconds": elapsed, "output_tokens_per_s": num_prompts * output_len / elapsed}


def run(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = ensure_bench_model(Path(args.model_dir) if args.model_dir else None)
    for dtype in args.dtypes:
        bandwidth = copy_bandwidth()
        emit(
            {
                "bench": "copy_bandwidth",
                "gb_per_s": bandwidth / 1e9,
                "threads": torch.get_num_threads(),
            }
        )
        worker = Worker("cpu")
        loaded = worker.load_model(
            LoadModelConfig.of(
                str(folder),
                dtype=dtype,
                max_num_batched_tokens=2048,
                max_num_seqs=256,
                block_size=BLOCK_SIZE,
            )
        )
        runner = worker.runner
        assert runner is not None
        embed = runner.model.get_submodule("embed_tokens")
        assert isinstance(embed, VocabParallelEmbedding)
        embed_bytes = embed.weight.numel() * embed.weight.element_size()
        read_bytes = loaded.weight_bytes - embed_bytes  # a step gathers a few embedding rows only
        num_blocks = 256 * (args.context + args.steps + 8) // BLOCK_SIZE + 256
        worker.initialize_kv_cache(num_blocks)
        assert runner.kv_cache is not None
        runner.kv_cache.zero_blocks(np.arange(num_blocks))  # finite contents everywhere
        session = Session(worker, num_blocks)
        floor_ms = 1e3 * read_bytes / bandwidth
        base = {"dtype": loaded.dtype, "weight_bytes_read": read_bytes, "floor_ms": floor_ms}
        for batch_size in args.batch_sizes:
            result = bench_decode(session, batch_size, args.context, args.steps)
            emit(
                {
                    "bench": "decode",
                    **base,
                    "batch_size": batch_size,
                    "context": args.context,
                    **result,
                    "tokens_per_s": batch_size / result["step_ms"] * 1e3,
                }
            )
        prefill_ms = bench_prefill(session, args.prefill_tokens, repeats=2)
        emit(
            {
                "bench": "prefill",
                **base,
                "tokens": args.prefill_tokens,
                "step_ms": prefill_ms,
                "tokens_per_s": args.prefill_tokens / prefill_ms * 1e3,
            }
        )
        emit(
            {
                "bench": "serve_like",
                "dtype": loaded.dtype,
                "num_prompts": 32,
                "prompt_len": 256,
                "output_len": 64,
                **bench_serve_like(session, 32, 256, 64, budget=2048),
            }
        )
        worker.shutdown()
        if args.lora:
            for record in bench_lora(folder, dtype, args.context, args.steps):
                emit(record)


def emit(record: dict[str, object]) -> None:
    print(
        json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in record.items()}),
        flush=True,
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32, 128, 256])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8, help="measured decode steps per size")
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--model-dir", default="", help="checkpoint folder (built if missing)")
    parser.add_argument(
        "--lora",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also the LoRA case (benchmarks/worker_lora.py)",
    )
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()

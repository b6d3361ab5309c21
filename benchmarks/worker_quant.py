"""`python -m benchmarks.worker_quant`: quantized weights against bf16 on one worker rank.

Loads the ~100M bench model (benchmarks/bench_model.py) once per variant (`--quantization`
none/int8/int4/w8a8: the serve flag's meanings, through the worker's own load path, bf16
compute) and reports, as JSON lines, medians over `--rounds` rounds that alternate the variants
(the machine is shared: a slow moment hits every variant alike):

* `step`: a prefill step of one `--prefill-tokens`-token prompt, and decode steps at batch 1
  and 32 (`context` tokens cached), wall and process CPU milliseconds (`Worker.execute`);
* `linear`: each linear shape of a layer (qkv, o, gate_up, down) at `--rows` rows: the
  variant's own linear method against the bf16 `F.linear` of the same shape, in the same round
  (wall and process CPU ms; on a busy machine `--threads 1` and the CPU times are the ones to
  trust: two threads waiting on each other's preempted half spin).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.bench_model import VOCAB_SIZE, ensure_bench_model
from benchmarks.worker import emit
from benchmarks.worker_steps import BLOCK_SIZE, Session, decode_cached
from splitserve_runtime.quantization_names import ONLINE_METHODS
from worker_svc.layers.linear import LinearBase
from worker_svc.model_loader.model_load import LoadModelConfig
from worker_svc.worker import Worker

LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def cpu_timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall ms, process CPU ms) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return 1e3 * (time.perf_counter() - wall), 1e3 * (time.process_time() - cpu)


class Variant:
    """One loaded worker (a `--quantization` value) and its step benchmarks."""

    def __init__(self, folder: Path, quantization: str, context: int) -> None:
        self.name = quantization
        self.worker = Worker("cpu")
        self.worker.load_model(
            LoadModelConfig.of(
                str(folder),
                dtype="bfloat16",
                max_num_batched_tokens=2048,
                max_num_seqs=64,
                block_size=BLOCK_SIZE,
                quantization="" if quantization == "none" else quantization,
            )
        )
        num_blocks = 64 * (context + 64) // BLOCK_SIZE + 64
        self.worker.initialize_kv_cache(num_blocks)
        runner = self.worker.runner
        assert runner is not None and runner.kv_cache is not None
        runner.kv_cache.zero_blocks(np.arange(num_blocks))
        self.model = runner.model
        self.session = Session(self.worker, num_blocks)
        self.context = context
        self.rng = np.random.default_rng(0)

    def prefill(self, num_tokens: int) -> tuple[float, float]:
        new = self.session.new_request(self.rng.integers(3, VOCAB_SIZE, num_tokens), 0, 1)
        result = cpu_timed(lambda: self.session.execute([new], [num_tokens]))
        self.session.execute([], [], finished=[new.req_handle])
        return result

    def decode(self, batch_size: int, steps: int) -> list[tuple[float, float]]:
        context = self.context
        news = [
            self.session.new_request(self.rng.integers(3, VOCAB_SIZE, context), context - 1, 99)
            for _ in range(batch_size)
        ]
        out, _ = self.session.execute(news, [1] * batch_size)
        handles = [n.req_handle for n in news]
        times = []
        for i in range(steps + 1):
            cached = decode_cached(handles, [context + i] * batch_size, out.sampled_token_ids)
            wall, cpu = time.perf_counter(), time.process_time()
            out, _ = self.session.execute([], [1] * batch_size, cached)
            if i > 0:  # warm-up
                times.append(
                    (1e3 * (time.perf_counter() - wall), 1e3 * (time.process_time() - cpu))
                )
        self.session.execute([], [], finished=handles)
        return times

    def linear(self, suffix: str, rows: int, repeats: int) -> tuple[float, float, float, float]:
        """This variant's (wall, CPU) ms and bf16 F.linear's at `rows` rows, medians."""
        layer = self.model.get_submodule(f"layers.0.{suffix}")
        assert isinstance(layer, LinearBase)
        x = torch.randn(rows, layer.input_size_per_rank, dtype=torch.bfloat16)
        weight = torch.randn(layer.output_size_per_rank, layer.input_size_per_rank).bfloat16()
        own, base = [], []
        for _ in range(repeats + 1):
            own.append(cpu_timed(lambda: layer(x)))
            base.append(cpu_timed(lambda: F.linear(x, weight)))
        wall, cpu = summary(own[1:]).values()
        bf16_wall, bf16_cpu = summary(base[1:]).values()
        return wall, cpu, bf16_wall, bf16_cpu


def summary(samples: Sequence[tuple[float, ...]]) -> dict[str, float]:
    return {
        "step_ms": statistics.median(s[0] for s in samples),
        "cpu_ms": statistics.median(s[1] for s in samples),
    }


def run(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = ensure_bench_model(Path(args.model_dir) if args.model_dir else None)
    variants = [Variant(folder, q, args.context) for q in args.quantization]
    steps: dict[tuple[str, str], list[tuple[float, float]]] = {}
    linears: dict[tuple[str, str], list[tuple[float, float, float, float]]] = {}
    for _ in range(args.rounds):
        for v in variants:  # alternating: each round runs every variant once
            steps.setdefault((v.name, "prefill"), []).append(v.prefill(args.prefill_tokens))
            for batch_size in (1, 32):
                steps.setdefault((v.name, f"decode{batch_size}"), []).extend(
                    v.decode(batch_size, args.steps)
                )
            for suffix in LINEARS:
                linears.setdefault((v.name, suffix), []).append(v.linear(suffix, args.rows, 3))
    load = os.getloadavg()[0]
    for (name, what), timed in steps.items():
        emit({"bench": "step", "quantization": name, "what": what, **summary(timed), "load": load})
    for (name, suffix), samples in linears.items():
        own, own_cpu, bf16, bf16_cpu = (statistics.median(s[i] for s in samples) for i in range(4))
        emit(
            {
                "bench": "linear",
                "quantization": name,
                "layer": suffix,
                "rows": args.rows,
                **{"ms": own, "cpu_ms": own_cpu, "bf16_ms": bf16, "bf16_cpu_ms": bf16_cpu},
                "cpu_ratio": own_cpu / bf16_cpu,
            }
        )
    for v in variants:
        v.worker.shutdown()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quantization",
        nargs="+",
        default=["none", *ONLINE_METHODS],
        choices=["none", *ONLINE_METHODS],
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="decode steps per round and batch")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--prefill-tokens", type=int, default=256)
    parser.add_argument("--rows", type=int, default=256, help="rows of the per-linear timing")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--model-dir", default="", help="checkpoint folder (built if missing)")
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()

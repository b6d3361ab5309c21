"""The LoRA case of `python -m benchmarks.worker`: one worker rank of the ~100M bench model with
8 adapter slots (rank 16, every attention and MLP projection), JSON lines:

* `lora_load`: seconds a rank takes to read one rank-16 adapter (LoadLoraAdapter's work: the
  PEFT files read, checked, sharded and cached), median of several;
* `lora_decode`: decode steps at batch 32 of the base model alone and of the same batch spread
  over 8 adapters (4 requests each), on the same LoRA-enabled worker, interleaved step by step
  (so both see the same machine); `ratio` is the mixed step's median over the base step's (the
  target: at most 1.3), `ratio_best` the same of each one's fastest step (on a shared machine
  the least disturbed), `ratio_cpu` of the process's CPU time per step (median; with
  `--threads 1` the work itself, whatever else the machine runs).

Adapters are written in PEFT's layout (adapter_config.json, adapter_model.safetensors) with
random weights under the bench model's folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from benchmarks.bench_model import BENCH_CONFIG, VOCAB_SIZE, ensure_bench_model
from benchmarks.worker_steps import BLOCK_SIZE, Session, decode_cached
from worker_svc.layers.lora import LoraShape
from worker_svc.model_loader.model_load import LoadModelConfig
from worker_svc.scheduler_output import LoraSlots, NewRequestData
from worker_svc.worker import Worker

NUM_ADAPTERS = 8
RANK = 16
BATCH = 32


def write_adapter(folder: Path, seed: int, rank: int = RANK) -> Path:
    """A random PEFT adapter of the bench model on every attention and MLP projection."""
    if (folder / "adapter_model.safetensors").exists():
        return folder
    config = BENCH_CONFIG
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])  # type: ignore[call-overload]
    head_dim = hidden // int(config["num_attention_heads"])  # type: ignore[call-overload]
    kv = int(config["num_key_value_heads"]) * head_dim  # type: ignore[call-overload]
    shapes = {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (hidden, inter),
        "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(config["num_hidden_layers"])):  # type: ignore[call-overload]
        for module, (num_in, num_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, num_in, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(num_out, rank, generator=gen) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.to(torch.bfloat16) for k, v in tensors.items()}, folder / "adapter_model.safetensors"
    )
    targets = sorted({m.split(".")[-1] for m in shapes})
    lora_config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": targets,
    }
    (folder / "adapter_config.json").write_text(json.dumps(lora_config))
    return folder


def bench_lora(model_dir: Path, dtype: str, context: int, steps: int) -> list[dict[str, object]]:
    """The `lora_load` and `lora_decode` records (see the module docstring)."""
    paths = [
        write_adapter(model_dir / "lora" / f"r{RANK}-{i}", seed=i) for i in range(NUM_ADAPTERS)
    ]
    worker = Worker("cpu")
    loaded = worker.load_model(
        LoadModelConfig.of(
            str(model_dir),
            dtype=dtype,
            max_num_batched_tokens=2048,
            max_num_seqs=256,
            block_size=BLOCK_SIZE,
            lora=LoraShape(NUM_ADAPTERS, RANK).options(),
        )
    )
    num_blocks = 2 * BATCH * (context + 2 * steps + 8) // BLOCK_SIZE + 64
    worker.initialize_kv_cache(num_blocks)
    assert worker.runner is not None and worker.runner.kv_cache is not None
    worker.runner.kv_cache.zero_blocks(np.arange(num_blocks))  # finite contents everywhere
    load_times = []
    for i, path in enumerate(paths):
        started = time.perf_counter()
        worker.keep_lora_adapter(worker.read_lora_adapter(i + 1, str(path)))
        load_times.append(time.perf_counter() - started)
    session = Session(worker, num_blocks)
    times = _interleaved(session, paths, context, steps)
    base_ms, lora_ms = (1e3 * statistics.median(times[k]) for k in ("base", "lora"))
    base_best, lora_best = (1e3 * min(times[k]) for k in ("base", "lora"))
    base_cpu, lora_cpu = (1e3 * statistics.median(times[f"{k}_cpu"]) for k in ("base", "lora"))
    worker.shutdown()
    return [
        {
            "bench": "lora_load",
            "dtype": loaded.dtype,
            "rank": RANK,
            "seconds": statistics.median(load_times),
        },  # fmt: skip
        {
            "bench": "lora_decode",
            "dtype": loaded.dtype,
            "batch_size": BATCH,
            "num_adapters": NUM_ADAPTERS,
            "rank": RANK,
            "base_step_ms": base_ms,
            "lora_step_ms": lora_ms,
            "ratio": lora_ms / base_ms,
            "base_step_best_ms": base_best,
            "lora_step_best_ms": lora_best,
            "ratio_best": lora_best / base_best,
            "base_step_cpu_ms": base_cpu,
            "lora_step_cpu_ms": lora_cpu,
            "ratio_cpu": lora_cpu / base_cpu,
        },
    ]


def _interleaved(
    session: Session, paths: list[Path], context: int, steps: int
) -> dict[str, list[float]]:
    """Two batches of 32 decoding side by side (base model; 8 adapters x 4 requests), stepped
    alternately: the seconds of each one's steps (after two warm-up steps)."""
    rng = np.random.default_rng(7)
    groups: dict[str, list[NewRequestData]] = {}
    for name, lora_of in (("base", lambda i: 0), ("lora", lambda i: 1 + i % NUM_ADAPTERS)):
        news = []
        for i in range(BATCH):
            prompt = rng.integers(3, VOCAB_SIZE, context)
            new = session.new_request(prompt, context - 1, 2 * steps + 8)
            news.append(dataclasses.replace(new, lora_id=lora_of(i)))
        groups[name] = news
    slots = LoraSlots(tuple(range(NUM_ADAPTERS)), tuple(range(1, NUM_ADAPTERS + 1)),
                      tuple(str(p) for p in paths))  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in ("base", "lora", "base_cpu", "lora_cpu")}
    last: dict[str, list[int]] = {}
    for name, news in groups.items():
        out, _ = session.execute(news, [1] * BATCH, lora_slots=slots if name == "lora" else None)
        last[name] = [dict(zip(out.req_handles, out.sampled_token_ids, strict=True))[n.req_handle]
                      for n in news]  # fmt: skip
    for i in range(steps + 2):
        for name, news in groups.items():
            handles = [n.req_handle for n in news]
            cached = decode_cached(handles, [context + i] * BATCH, last[name])
            cpu_started = time.process_time()
            out, elapsed = session.execute([], [1] * BATCH, cached)
            cpu = time.process_time() - cpu_started
            by_handle = dict(zip(out.req_handles, out.sampled_token_ids, strict=True))
            last[name] = [by_handle[h] for h in handles]
            if i >= 2:
                times[name].append(elapsed)
                times[f"{name}_cpu"].append(cpu)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=24, help="measured steps of each batch")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--model-dir", default="", help="checkpoint folder (built if missing)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = ensure_bench_model(Path(args.model_dir) if args.model_dir else None)
    for dtype in args.dtypes:
        for record in bench_lora(folder, dtype, args.context, args.steps):
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                              for k, v in record.items()}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

"""`python -m benchmarks.gpu.paged_decode`: paged attention and a whole decode step on an
8B-shaped bf16 model (Llama-3-8B: hidden 4096, 32 heads, 8 KV heads, head_dim 128, 32 layers,
intermediate 14336), against the HBM roofline.

Two parts, each reported as JSON lines and written together to `--out` (default
`$OUT/paged_decode.json` when `$OUT` is set):

* `attention`: one layer's decode attention (the KV write and the paged read) for each backend
  (our Triton kernel at block size 16, flash-attn's paged path at 256), for batch x context.
  Bytes = the KV rows a decode reads (keys and values of every context token) plus the query,
  output and written rows; `roofline_fraction` = (bytes / time) / `--hbm-gbps`. Before timing,
  each backend's output is checked against the torch reference on the same cache contents.
* `decode_step`: a whole decode step of the 8B shape (RMSNorm, QKV, paged attention, O, SiLU-gated
  MLP, residuals in every layer), eager and replayed from a CUDA graph, beside the roofline of
  the bytes it must read (every weight once, plus the KV cache).

`--smoke` runs tiny shapes on the CPU with the torch backend (and the Triton kernel when
TRITON_INTERPRET=1 is set) so `make test` keeps this script working on machines without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from worker_svc.attention.backend import AttentionBackend, AttentionInputs
from worker_svc.attention.flash_attn_backend import FLASH_ATTN_BLOCK_MULTIPLE
from worker_svc.attention.selector import backend_class

H200_HBM_GBPS = 4800.0
BLOCK_SIZES = {"torch": 16, "triton": 16, "flash_attn": FLASH_ATTN_BLOCK_MULTIPLE}


@dataclass(frozen=True)
class Shape:
    hidden: int = 4096
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    num_layers: int = 32


SMOKE_SHAPE = Shape(
    hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate=128, num_layers=2
)


def decode_inputs(batch: int, context: int, block_size: int, seed: int = 0) -> AttentionInputs:
    """`batch` requests decoding their token number `context`, blocks scattered over the cache."""
    blocks_per_req = -(-context // block_size)
    rng = np.random.default_rng(seed)
    block_ids = rng.permutation(batch * blocks_per_req).reshape(batch, blocks_per_req) + 1
    last = context - 1
    slots = block_ids[:, last // block_size] * block_size + last % block_size
    return AttentionInputs(
        query_start_loc=np.arange(batch + 1, dtype=np.int64),
        seq_lens=np.full(batch, context, dtype=np.int64),
        block_tables=block_ids.astype(np.int64),
        slot_mapping=slots.astype(np.int64),
        block_size=block_size,
        null_block_id=0,
    )


def make_backend(
    name: str, shape: Shape, dtype: torch.dtype, device: torch.device
) -> AttentionBackend:
    cls = backend_class(name)
    return cls(shape.num_heads, shape.num_kv_heads, shape.head_dim, dtype=dtype, device=device)


def prefill_inputs(decode: AttentionInputs) -> AttentionInputs:
    """The prompt step before `decode`: every earlier token of each request at once."""
    batch, context = decode.num_reqs, int(decode.seq_lens[0]) - 1
    positions = np.arange(context)
    tables, size = decode.block_tables, decode.block_size
    slots = tables[:, positions // size] * size + positions % size
    return AttentionInputs(
        query_start_loc=np.arange(batch + 1, dtype=np.int64) * context,
        seq_lens=np.full(batch, context, dtype=np.int64),
        block_tables=tables,
        slot_mapping=slots.reshape(-1),
        block_size=size,
        null_block_id=0,
    )


def decode_output(
    name: str, shape: Shape, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> torch.Tensor:
    """Prefill 3 requests of 299 tokens, then decode token 300: the decode's attention output."""
    backend = make_backend(name, shape, dtype, device)
    decode = decode_inputs(3, 300, BLOCK_SIZES[name], seed)
    prefill = prefill_inputs(decode)
    num_blocks = int(decode.block_tables.max()) + 1
    kv_cache = torch.zeros(
        backend.kv_cache_shape(num_blocks, decode.block_size), dtype=dtype, device=device
    )
    gen = torch.Generator().manual_seed(seed)

    def rows(n: int, heads: int) -> torch.Tensor:
        return torch.randn(n, heads, shape.head_dim, generator=gen).to(device, dtype)

    for step in (prefill, decode):
        q, k, v = (
            rows(step.num_tokens, shape.num_heads),
            rows(step.num_tokens, shape.num_kv_heads),
            rows(step.num_tokens, shape.num_kv_heads),
        )
        out = backend.forward(q, k, v, kv_cache, backend.build_metadata(step))
    return out.float().cpu()


def max_error_vs_torch(name: str, shape: Shape, dtype: torch.dtype, device: torch.device) -> float:
    """Largest absolute difference from the torch backend on the same keys, values and queries."""
    reference = decode_output("torch", shape, torch.float32, device)
    return float((decode_output(name, shape, dtype, device) - reference).abs().max())


def time_call(fn: Callable[[], object], device: torch.device, iters: int = 20) -> float:
    """Median seconds per call after warm-up (CUDA events on a GPU, perf_counter elsewhere)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def attention_bytes(shape: Shape, batch: int, context: int, itemsize: int) -> int:
    """What one layer's decode attention must move: every context token's key and value, the
    query and output rows, and the new key/value rows written."""
    kv_read = batch * context * shape.num_kv_heads * shape.head_dim * 2
    q_out = batch * shape.num_heads * shape.head_dim * 2
    kv_write = batch * shape.num_kv_heads * shape.head_dim * 2
    return (kv_read + q_out + kv_write) * itemsize


def time_attention(
    name: str, shape: Shape, batch: int, context: int, args: argparse.Namespace
) -> dict[str, object]:
    device, dtype = torch.device(args.device), args.torch_dtype
    backend = make_backend(name, shape, dtype, device)
    inputs = decode_inputs(batch, context, BLOCK_SIZES[name])
    num_blocks = int(inputs.block_tables.max()) + 1
    kv_cache = torch.randn(
        backend.kv_cache_shape(num_blocks, inputs.block_size), dtype=dtype, device=device
    )
    metadata = backend.build_metadata(inputs)
    q = torch.randn(batch, shape.num_heads, shape.head_dim, dtype=dtype, device=device)
    k = torch.randn(batch, shape.num_kv_heads, shape.head_dim, dtype=dtype, device=device)
    seconds = time_call(lambda: backend.forward(q, k, k, kv_cache, metadata), device, args.iters)
    num_bytes = attention_bytes(shape, batch, context, kv_cache.element_size())
    gbps = num_bytes / seconds / 1e9
    return {
        "part": "attention",
        "backend": name,
        "batch": batch,
        "context": context,
        "block_size": inputs.block_size,
        "us": round(seconds * 1e6, 1),
        "gbps": round(gbps, 1),
        "roofline_fraction": round(gbps / args.hbm_gbps, 3),
    }


class DecodeStack:
    """The shape's decoder layers with random weights (RoPE left out: elementwise, a few µs)."""

    def __init__(
        self, backend: AttentionBackend, shape: Shape, num_blocks: int, block_size: int
    ) -> None:
        self.backend, self.shape = backend, shape
        dtype, device = backend.dtype, backend.device
        qkv_width = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim

        def weight(rows: int, cols: int) -> torch.Tensor:
            return torch.empty(rows, cols, dtype=dtype, device=device).normal_(std=0.02)

        self.layers = [
            (
                weight(shape.hidden, qkv_width),
                weight(shape.num_heads * shape.head_dim, shape.hidden),
                weight(shape.hidden, 2 * shape.intermediate),
                weight(shape.intermediate, shape.hidden),
                torch.zeros(
                    backend.kv_cache_shape(num_blocks, block_size), dtype=dtype, device=device
                ),
            )
            for _ in range(shape.num_layers)
        ]

    @property
    def weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for layer in self.layers for w in layer[:4])

    def forward(self, hidden: torch.Tensor, metadata: object) -> torch.Tensor:
        s = self.shape
        q_width, kv_width = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        for w_qkv, w_o, w_gate_up, w_down, kv_cache in self.layers:
            qkv = torch.nn.functional.rms_norm(hidden, (s.hidden,)) @ w_qkv
            q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)
            heads = (-1, s.head_dim)
            attn = self.backend.forward(
                q.reshape(q.shape[0], *heads),
                k.reshape(k.shape[0], *heads),
                v.reshape(v.shape[0], *heads),
                kv_cache,
                metadata,
            )
            hidden = hidden + attn.reshape(hidden.shape[0], q_width) @ w_o
            gate, up = (torch.nn.functional.rms_norm(hidden, (s.hidden,)) @ w_gate_up).chunk(
                2, dim=-1
            )
            hidden = hidden + (torch.nn.functional.silu(gate) * up) @ w_down
        return hidden


def graph_replay(
    stack: DecodeStack, hidden: torch.Tensor, metadata: object
) -> Callable[[], object]:
    """Capture one decode step in a CUDA graph (after warm-up on a side stream); its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            stack.forward(hidden, metadata)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stack.forward(hidden, metadata)
    return graph.replay


def time_decode_step(
    name: str, shape: Shape, batch: int, context: int, args: argparse.Namespace
) -> dict[str, object]:
    device, dtype = torch.device(args.device), args.torch_dtype
    backend = make_backend(name, shape, dtype, device)
    inputs = decode_inputs(batch, context, BLOCK_SIZES[name])
    stack = DecodeStack(backend, shape, int(inputs.block_tables.max()) + 1, inputs.block_size)
    metadata = backend.build_metadata(inputs)
    hidden = torch.randn(batch, shape.hidden, dtype=dtype, device=device)
    with torch.inference_mode():
        eager = time_call(lambda: stack.forward(hidden, metadata), device, args.iters)
        graph = (
            time_call(graph_replay(stack, hidden, metadata), device, args.iters)
            if device.type == "cuda"
            else None
        )
    itemsize = torch.finfo(dtype).bits // 8
    num_bytes = stack.weight_bytes + shape.num_layers * attention_bytes(
        shape, batch, context, itemsize
    )
    roofline = num_bytes / (args.hbm_gbps * 1e9)
    best = min(t for t in (eager, graph) if t is not None)
    return {
        "part": "decode_step",
        "backend": name,
        "batch": batch,
        "context": context,
        "eager_ms": round(eager * 1e3, 3),
        "graph_ms": None if graph is None else round(graph * 1e3, 3),
        "roofline_ms": round(roofline * 1e3, 3),
        "roofline_fraction": round(roofline / best, 3),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu.paged_decode", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--backends", nargs="+", default=["triton", "flash_attn"], help="attention backends to time"
    )
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16, 64, 128])
    p.add_argument("--contexts", nargs="+", type=int, default=[1024, 4096, 16384])
    p.add_argument(
        "--step-batch-sizes", nargs="+", type=int, default=[1, 16, 64], help="whole decode step"
    )
    p.add_argument(
        "--step-context", type=int, default=2048, help="context of the whole decode step"
    )
    p.add_argument(
        "--hbm-gbps",
        type=float,
        default=H200_HBM_GBPS,
        help="memory bandwidth roofline (H200: 4800)",
    )
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument(
        "--out", type=Path, default=None, help="JSON results (default $OUT/paged_decode.json)"
    )
    p.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU: checks the script runs"
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.backends = ["torch"] + (
            ["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else []
        )
        args.batch_sizes, args.contexts, args.step_batch_sizes = [2], [40], [2]
        args.step_context, args.iters, args.dtype = 40, 2, "float32"
    args.device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    args.torch_dtype = getattr(torch, args.dtype)
    if args.out is None and os.environ.get("OUT"):
        args.out = Path(os.environ["OUT"]) / "paged_decode.json"
    return args


def runnable_backends(args: argparse.Namespace) -> list[str]:
    """The requested backends that can run here; the others are reported and skipped."""
    device, names = torch.device(args.device), []
    for name in args.backends:
        reason = backend_class(name).unsupported_reason(device, BLOCK_SIZES[name], args.torch_dtype)
        if reason is None:
            names.append(name)
        else:
            print(json.dumps({"part": "skipped", "backend": name, "reason": reason}), flush=True)
    return names


def run(args: argparse.Namespace) -> Iterator[dict[str, object]]:
    shape = SMOKE_SHAPE if args.smoke else Shape()
    device = torch.device(args.device)
    backends = runnable_backends(args)
    for name in backends:
        error = max_error_vs_torch(name, shape, args.torch_dtype, device)
        yield {"part": "check", "backend": name, "max_abs_error_vs_torch": error}
    for name in backends:
        for batch in args.batch_sizes:
            yield from (time_attention(name, shape, batch, ctx, args) for ctx in args.contexts)
        for batch in args.step_batch_sizes:
            yield time_decode_step(name, shape, batch, args.step_context, args)
            if device.type == "cuda":
                torch.cuda.empty_cache()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    print(
        json.dumps(
            {
                "part": "machine",
                "device": args.device,
                "shape": asdict(SMOKE_SHAPE if args.smoke else Shape()),
                "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
            }
        ),
        flush=True,
    )
    rows: list[dict[str, object]] = []
    for row in run(args):
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()

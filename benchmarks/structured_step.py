"""`python -m benchmarks.structured_step`: where a constrained step's extra time goes, in-process.

The pieces structured outputs add to a decode step, each timed alone on the benchmark
tokenizer (32000 tokens) with benchmarks/structured_schemas.RECORDS, at batch 1 and 32:

* core, fill: StructuredOutputManager.fill_bitmask (llguidance's parallel fill into packed
  int32 rows, then the bytes that travel with the step);
* worker, decode + apply: grammar_bitmask_from_bytes, then apply_grammar_bitmask on fp32 logits
  [batch, 32000], by numpy (a rank without the CPU kernels) and by sampling_ops.cpp;
* the wire, end to end: the core's fill + encoding (dense, or sparse when smaller:
  core_svc/structured_output/structured_bitmask.py) + serialisation of the deferred-mask message, its bytes, and
  the rank's parse + decode + apply (CPU kernels).

Matchers walk a random path through the grammar first (tokens drawn from their own masks), so
the masks are the mixed states a real output passes through (inside strings most tokens are
allowed, between keys few). Prints per-step milliseconds (best and median of the repeats); the
whole-stack effect is benchmarks/structured_cost.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from benchmarks.bench_model import VOCAB_SIZE, ensure_bench_model
from benchmarks.structured_schemas import RECORDS, as_text
from core_svc import convert as core_convert
from core_svc.sched.scheduler_output import GrammarBitmask, SchedulerOutput
from core_svc.structured_output.grammar_state import StructuredOutputRequest
from core_svc.structured_output.manager import StructuredOutputManager, StructuredOutputsConfig
from splitserve_contracts.structured_outputs import StructuredOutputsParams
from splitserve_contracts.worker.v1 import worker_service_pb2 as pb
from worker_svc import convert as worker_convert
from worker_svc.kernels.cpu_kernels import CpuKernels
from worker_svc.sample.grammar_bitmask import apply_grammar_bitmask, grammar_bitmask_from_bytes

WALK_TOKENS = 40


def timed(fn: Callable[[], object], repeats: int) -> dict[str, float]:
    fn()
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - started)
    return {
        "best_ms": round(1e3 * min(seconds), 3),
        "median_ms": round(1e3 * statistics.median(seconds), 3),
    }


def constrained_states(
    manager: StructuredOutputManager, num_requests: int, seed: int
) -> list[StructuredOutputRequest]:
    """Compiled RECORDS matchers, each WALK_TOKENS random allowed tokens into its document."""
    params = StructuredOutputsParams(json=as_text(RECORDS))
    states = [StructuredOutputRequest(params) for _ in range(num_requests)]
    for handle, state in enumerate(states):
        assert manager.submit(handle, 1, state, []) is None
    while manager.num_compiling:
        ready, failed = manager.take_compiled(time.monotonic())
        assert not failed, failed
        time.sleep(0.01)
    rng = np.random.default_rng(seed)
    for _ in range(WALK_TOKENS):
        words = np.frombuffer(manager.fill_bitmask(states), "<i4").reshape(num_requests, -1)
        for state, row in zip(states, words, strict=True):
            allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
            assert state.accept(int(rng.choice(allowed)))
    return states


def measure(manager: StructuredOutputManager, batch: int, repeats: int) -> dict[str, object]:
    states = constrained_states(manager, batch, seed=batch)
    data = manager.fill_bitmask(states)
    handles = list(range(batch))
    sampling_handles = np.arange(batch, dtype=np.int64)
    logits = torch.randn(batch, VOCAB_SIZE)

    def worker_side(kernels: CpuKernels | None) -> Callable[[], None]:
        def apply() -> None:
            grammar = grammar_bitmask_from_bytes(handles, data)
            assert grammar is not None
            apply_grammar_bitmask(logits, sampling_handles, grammar, kernels)

        return apply

    def core_wire() -> bytes:
        bitmask = GrammarBitmask(handles, manager.fill_bitmask(states))
        step = SchedulerOutput(step_id=1, grammar_bitmask=bitmask)
        return core_convert.grammar_output_to_proto(step).SerializeToString()

    payload = core_wire()

    def worker_wire() -> None:
        received = pb.ExecuteRequest.FromString(payload).grammar_output.grammar_bitmask
        grammar = worker_convert.grammar_bitmask_from_proto(received)
        assert grammar is not None
        apply_grammar_bitmask(logits, sampling_handles, grammar, CpuKernels.load())

    allowed = np.unpackbits(np.frombuffer(data, np.uint8)).reshape(batch, -1).sum(axis=1)
    return {
        "batch": batch,
        "bitmask_bytes": len(data),
        "wire_message_bytes": len(payload),
        "core_fill_encode_serialize": timed(core_wire, repeats),
        "worker_parse_decode_apply_kernel": timed(worker_wire, repeats),
        "allowed_tokens_median": int(np.median(allowed)),
        "core_fill": timed(lambda: manager.fill_bitmask(states), repeats),
        "worker_decode_apply_numpy": timed(worker_side(None), repeats),
        "worker_decode_apply_kernel": timed(worker_side(CpuKernels.load()), repeats),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)
    tokenizer_json = (ensure_bench_model() / "tokenizer.json").read_text()
    manager = StructuredOutputManager(VOCAB_SIZE, StructuredOutputsConfig())
    manager.set_tokenizer(1, tokenizer_json, [2])
    for batch in (1, 32):
        print(json.dumps(measure(manager, batch, args.repeats)), flush=True)
    manager.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`python -m benchmarks.latency_policy`: the scheduler's latency policy on W1/W3, in model time.

Runs the real EngineCore (scheduler, KV-cache manager) against an executor that plays the
worker and charges every step a modelled duration, on a virtual clock:

    step seconds = fixed + prefill_token * (prompt tokens) + decode * (decoding requests)
                   + context_token * (context tokens the decodes attend to)

so a policy's effect on TTFT and inter-token latency (ITL) is measured without the noise of a
shared machine, in seconds instead of minutes. The default coefficients were fitted to
`python -m benchmarks.worker` on the 2-core benchmark machine (bf16, ~100M Llama, including
~1 ms per step for the hops); pass your own with the flags. Real runs (benchmarks.serve_compare)
confirm the choice.

With --async-scheduling (the default, as the served stack's) the engine sends the next step
while the worker runs the current one, and a step waits for the worker to be free: a request
that arrives meanwhile waits behind the step built ahead without it.

Workloads (the issue's, the same shapes and arrivals as `benchmarks.peer`'s seed 0): W1 = 32 x
(256 in, 64 out) at once -> output tok/s; W3 = 64 requests, input 128-384, output 48-144,
Poisson arrivals at 2 req/s -> TTFT p99, ITL p99; W3-burst = the same 64 at once -> output
tok/s. Prints one JSON line per (policy, workload) over the product of the policy flags given,
and for W3 the slowest first tokens split into their parts (waiting in the core's queue,
behind a step in flight, prefill; the steps and prompt tokens ahead of it) and the longest
inter-token gaps with the steps that made them (benchmarks/latency_breakdown.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from benchmarks.latency_breakdown import (
    StepRecord,
    TtftBreakdown,
    itl_gap_causes,
    slowest,
    ttft_breakdown,
)
from benchmarks.scheduler import VOCAB_SIZE, TrivialExecutor, bench_engine
from core_svc.config import CoreConfig
from core_svc.request import Request
from core_svc.sched.scheduler_output import SchedulerOutput
from splitserve_contracts.output_types import ModelRunnerOutput

MAX_MODEL_LEN = 1024


@dataclass(frozen=True)
class StepCost:
    """Coefficients of the modelled step duration, in seconds."""

    fixed: float = 0.0095
    prefill_token: float = 0.00022
    decode: float = 0.00012
    context_token: float = 0.0000008

    def seconds(self, so: SchedulerOutput) -> float:
        computed = [r.num_computed_tokens for r in so.scheduled_new_reqs]
        computed += so.scheduled_cached_reqs.num_computed_tokens
        num_prefill = num_decodes = num_context = 0
        for num_computed, num_new in zip(computed, so.num_scheduled_tokens, strict=True):
            if num_new == 1 and num_computed > 0:
                num_decodes += 1
                num_context += num_computed
            else:
                num_prefill += num_new
        return (
            self.fixed
            + self.prefill_token * num_prefill
            + self.decode * num_decodes
            + self.context_token * num_context
        )


class TimedExecutor(TrivialExecutor):
    """The trivial worker on the virtual clock: a step sent at `clock` starts when the worker
    is free and lasts its modelled duration; `steps` logs them in the order they ran."""

    def __init__(self, cost: StepCost) -> None:
        super().__init__(with_proto=False)
        self.cost = cost
        self.clock = 0.0
        """Virtual time at which the engine sends (the simulator sets it)."""
        self.busy_until = 0.0
        self.steps: list[StepRecord] = []

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        so = scheduler_output
        start = max(self.clock, self.busy_until)
        self.busy_until = start + self.cost.seconds(so)
        handles = [
            r.req_handle for r in so.scheduled_new_reqs
        ] + so.scheduled_cached_reqs.req_handles
        computed = [r.num_computed_tokens for r in so.scheduled_new_reqs]
        computed += so.scheduled_cached_reqs.num_computed_tokens
        num_new = dict(zip(handles, so.num_scheduled_tokens, strict=True))
        prefills = frozenset(
            h
            for h, c, n in zip(handles, computed, so.num_scheduled_tokens, strict=True)
            if not (n == 1 and c > 0)
        )
        self.steps.append(StepRecord(self.clock, start, self.busy_until, num_new, prefills))
        return super().execute_model(so)


@dataclass(frozen=True)
class Spec:
    num_prompt_tokens: int
    max_tokens: int
    arrival: float


def w1() -> list[Spec]:
    return [Spec(256, 64, 0.0)] * 32


def w3(burst: bool, seed: int = 3) -> list[Spec]:
    """64 requests, input 128-384, output 48-144; Poisson at 2 req/s, or all at once."""
    shapes = random.Random(f"{seed}:shapes")
    lengths = [(shapes.randint(128, 384), shapes.randint(48, 144)) for _ in range(64)]
    arrivals = random.Random(f"{seed}:arrivals")
    clock, specs = 0.0, []
    for num_in, num_out in lengths:
        specs.append(Spec(num_in, num_out, 0.0 if burst else clock))
        clock += arrivals.expovariate(2.0)
    return specs


@dataclass
class Run:
    """What one simulated workload left: per request (by arrival order) its spec, req_handle
    and token times, and the step log."""

    specs: list[Spec]
    req_handles: list[int]
    token_times: dict[int, list[float]]
    steps: list[StepRecord]


def simulate(config: CoreConfig, cost: StepCost, specs: list[Spec]) -> Run:
    """Run `specs` to completion on the virtual clock. With async scheduling the engine sends
    the next step while the worker runs the current one, as the real loop does: a step built
    at `clock` waits for the worker to be free."""
    executor = TimedExecutor(cost)
    engine = bench_engine(config, 20_000, MAX_MODEL_LEN, executor)
    rng = random.Random(0)
    pending = sorted(enumerate(specs), key=lambda item: item[1].arrival)
    token_times: dict[int, list[float]] = {handle: [] for handle in range(len(specs))}
    req_handles = [0] * len(specs)
    clock = 0.0
    while pending or engine.has_work():
        while pending and pending[0][1].arrival <= clock:
            handle, spec = pending.pop(0)
            prompt = [rng.randrange(10, VOCAB_SIZE) for _ in range(spec.num_prompt_tokens)]
            request = Request(1, handle, f"r{handle}", prompt, max_tokens=spec.max_tokens)
            engine.add_request(request)
            req_handles[handle] = request.req_handle
        if not engine.has_work():
            clock = pending[0][1].arrival
            continue
        executor.clock = clock
        num_applied = engine.num_steps_applied
        outputs = engine.step()
        if engine.num_steps_applied > num_applied:
            clock = max(clock, executor.steps[engine.num_steps_applied - 1].end)
        for out in outputs.values():
            for handle, count in zip(out.request_handles, out.num_new_tokens, strict=True):
                token_times[handle].extend([clock] * count)
    return Run(specs, req_handles, token_times, executor.steps)


def summarize(run: Run) -> dict[str, float]:
    specs, token_times = run.specs, run.token_times
    ttfts = [token_times[h][0] - spec.arrival for h, spec in enumerate(specs)]
    itls = [b - a for times in token_times.values() for a, b in zip(times, times[1:], strict=False)]
    end = max(times[-1] for times in token_times.values())
    num_tokens = sum(len(times) for times in token_times.values())
    return {
        "output_tok_s": num_tokens / (end - min(s.arrival for s in specs)),
        "ttft_p99_ms": 1e3 * percentile(ttfts, 0.99),
        "ttft_mean_ms": 1e3 * sum(ttfts) / len(ttfts),
        "itl_p99_ms": 1e3 * percentile(itls, 0.99),
        "itl_p50_ms": 1e3 * percentile(itls, 0.5),
    }


def breakdown(run: Run, num: int) -> list[TtftBreakdown]:
    """The `num` slowest first tokens (the p99 lies between the first two of 64), each split
    into its parts (benchmarks/latency_breakdown.py)."""
    specs, times = run.specs, run.token_times
    ttfts = [times[h][0] - spec.arrival for h, spec in enumerate(specs)]
    return [
        ttft_breakdown(
            run.req_handles[h], specs[h].num_prompt_tokens, specs[h].arrival, times[h][0], run.steps
        )
        for h in slowest(ttfts, num)
    ]


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default, as `vllm bench` reports)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--prefill-token-budgets", type=int, nargs="+", default=[0])
    parser.add_argument("--long-prefill-token-thresholds", type=int, nargs="+", default=[0])
    parser.add_argument("--adaptive-prefill-chunks", type=int, nargs="+", default=[0])
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="schedule a step ahead, as the served stack does by default",
    )
    parser.add_argument("--workloads", nargs="+", default=["W1", "W3", "W3-burst"])
    parser.add_argument(
        "--seed", type=int, default=3, help="W3's shapes and arrivals (3: benchmarks.peer's)"
    )
    parser.add_argument(
        "--breakdown",
        type=int,
        default=3,
        metavar="N",
        help="for W3, print the N slowest first tokens split into their parts and the N "
        "longest inter-token gaps with the steps that made them (0: none)",
    )
    defaults = StepCost()
    for name in ("fixed", "prefill_token", "decode", "context_token"):
        flag = "--" + name.replace("_", "-") + "-seconds"
        parser.add_argument(flag, type=float, default=getattr(defaults, name))
    args = parser.parse_args(argv)
    cost = StepCost(
        args.fixed_seconds,
        args.prefill_token_seconds,
        args.decode_seconds,
        args.context_token_seconds,
    )
    workloads = {
        "W1": w1(),
        "W3": w3(burst=False, seed=args.seed),
        "W3-burst": w3(burst=True, seed=args.seed),
    }
    for budget, threshold, chunk in itertools.product(
        args.prefill_token_budgets, args.long_prefill_token_thresholds, args.adaptive_prefill_chunks
    ):
        config = CoreConfig.of(
            model="bench",
            max_num_seqs=64,
            max_num_batched_tokens=args.max_num_batched_tokens,
            long_prefill_token_threshold=threshold,
            prefill_token_budget=budget,
            adaptive_prefill_chunk=chunk,
            async_scheduling=args.async_scheduling,
            max_recovery_seconds=0.0,
        )
        policy = {
            "prefill_token_budget": budget,
            "long_prefill_token_threshold": threshold,
            "adaptive_prefill_chunk": chunk,
        }
        for name in args.workloads:
            run = simulate(config, cost, workloads[name])
            row = policy | {"workload": name}
            print(json.dumps(row | {k: round(v, 1) for k, v in summarize(run).items()}), flush=True)
            if name == "W3" and args.breakdown:
                for parts in breakdown(run, args.breakdown):
                    fields = {k: round(v, 1) for k, v in asdict(parts).items()}
                    print(json.dumps({"slow_ttft": fields}), flush=True)
                for gap in itl_gap_causes(run.token_times, run.steps, args.breakdown):
                    print(json.dumps({"slow_itl": gap}), flush=True)


if __name__ == "__main__":
    main()

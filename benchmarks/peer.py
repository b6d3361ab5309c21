"""`make bench-peer` / `python -m benchmarks.peer`: splitserve against vLLM's `vllm serve`.

Both systems serve the benchmark checkpoint (benchmarks/bench_model.py: ~100M random Llama,
bf16) with the same dtype, max_model_len and max_num_seqs, one at a time (never both at once),
in alternating order over N rounds (ABBA...: round 1 splitserve first, round 2 vLLM first, so a
drift of the machine's speed hits both). One client (benchmarks/peer_client.py) drives both
with the same requests (benchmarks/peer_workloads.py); only the transport differs: splitserve's
public gRPC (or its OpenAI HTTP endpoint, `--splitserve-transport http`, once it has one) and
vLLM's OpenAI `/v1/completions` SSE. Each server is warmed up with one short request first.

Reports one table (medians over rounds, each round's value, splitserve / vLLM) and writes every
round to `.bench/peer-results.json`. `--splitserve-variant NAME=FLAGS` adds more splitserve
configurations to the same run (e.g. quantized weights), each with its own column and ratio.
Not part of `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import io
import json
import os
import platform
import shlex
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from benchmarks.bench_model import VOCAB_SIZE, ensure_bench_model
from benchmarks.peer_client import GrpcTransport, OpenAIHttpTransport, Transport, run_workload
from benchmarks.peer_http import http_get_ok
from benchmarks.peer_machine import OthersMeter, others_busy_share, wait_for_quiet
from benchmarks.peer_servers import (
    LOOPBACK,
    VLLM_ENV,
    ServerError,
    ServerProcess,
    shell_line,
    splitserve_command,
    splitserve_has_http,
    splitserve_ready_addr,
    start,
    stop,
    vllm_command,
    vllm_is_ready,
    wait_ready,
)
from benchmarks.peer_stats import render_systems_table, round_metrics, summarize
from benchmarks.peer_workloads import Suite, Workload, build_suite
from splitserve.loopback_ports import free_ports

BENCH_DIR = Path(".bench")
DEFAULT_VLLM_PYTHON = BENCH_DIR / "vllm-venv" / "bin" / "python"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peer", description=__doc__)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (medians reported)")
    p.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON), help="the vLLM venv's python")
    p.add_argument(
        "--splitserve-transport",
        choices=("grpc", "http"),
        default="grpc",
        help="grpc: the public GenerationService; http: OpenAI /v1/completions on --http-port",
    )
    p.add_argument(
        "--splitserve-http-port",
        type=int,
        default=0,
        help="with --splitserve-transport http (0: any)",
    )
    p.add_argument(
        "--splitserve-flags",
        default="",
        help='more `splitserve up` flags, one string (e.g. "--async-scheduling", which vLLM-CPU '
        "has on by default)",
    )
    p.add_argument(
        "--splitserve-variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help='one more splitserve configuration in the same run, e.g. int8="--quantization int8" '
        "(repeatable): its own rows beside splitserve's and vLLM's, in every round",
    )
    p.add_argument(
        "--model",
        default="",
        help="a checkpoint folder both systems serve (default: the benchmark checkpoint, built "
        "if missing), e.g. a compressed-tensors W8A8 one",
    )
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=64, help="fits W3-burst's 64 at once")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=0,
        help="per-step token budget for both (0: each system's own default)",
    )
    p.add_argument("--num-w2-repeats", type=int, default=3, help="W2 requests in turn (median)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument(
        "--quiet-cpu-max",
        type=float,
        default=0.25,
        help="before each server starts and each timed workload, wait until other processes "
        "keep the CPUs at most this busy (other work on a shared machine moves every number)",
    )
    p.add_argument(
        "--quiet-timeout", type=float, default=300.0, help="seconds per wait, then go on"
    )
    p.add_argument("--output", type=Path, default=BENCH_DIR / "peer-results.json")
    return p


def common_flags(args: argparse.Namespace) -> list[str]:
    """The flags both systems get, with vLLM's names and meanings."""
    flags = ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len)]
    flags += ["--max-num-seqs", str(args.max_num_seqs)]
    if args.max_num_batched_tokens:
        flags += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    return flags


@dataclass
class Launch:
    """How to start one system and talk to it once it is ready."""

    name: str
    command: list[str]
    env: dict[str, str]
    is_ready: Callable[[ServerProcess], bool]
    connect: Callable[[ServerProcess], Callable[[], Transport]]
    """Checks the ready server's wire; returns a transport factory (called inside the event
    loop: a gRPC aio channel belongs to the loop it is made in)."""


def splitserve_variants(args: argparse.Namespace) -> dict[str, str]:
    """System name -> its extra `splitserve up` flags: "splitserve", then each variant as
    "splitserve[NAME]" (NAME=FLAGS; a malformed one is a usage error)."""
    variants = {"splitserve": args.splitserve_flags}
    for spec in args.splitserve_variant:
        name, is_named, flags = spec.partition("=")
        if not is_named or not name.isidentifier():
            raise SystemExit(f"--splitserve-variant {spec!r}: expected NAME=FLAGS, e.g. int8=...")
        variants[f"splitserve[{name}]"] = f"{args.splitserve_flags} {flags}"
    return variants


def splitserve_launch(
    args: argparse.Namespace, model: str, name: str = "splitserve", extra_flags: str | None = None
) -> Launch:
    extra = args.splitserve_flags if extra_flags is None else extra_flags
    flags = [*common_flags(args), "--log-level", "warning", *shlex.split(extra)]
    command = splitserve_command(model, free_ports(1)[0], flags)
    if args.splitserve_transport == "grpc":
        return Launch(name, command, {}, _has_ready_line, _grpc_connect)
    if not splitserve_has_http(command[: command.index("up")]):
        raise ServerError(
            "--splitserve-transport http: `splitserve up` has no --http-port flag (no OpenAI "
            "HTTP endpoint yet; issue 12 adds /v1/completions); use --splitserve-transport grpc"
        )
    port = args.splitserve_http_port or free_ports(1)[0]
    command += ["--http-port", str(port)]
    return Launch(name, command, {}, _has_ready_line, _http_connect(port, model))


def _has_ready_line(server: ServerProcess) -> bool:
    return splitserve_ready_addr(server) is not None


def _grpc_connect(server: ServerProcess) -> Callable[[], Transport]:
    addr = splitserve_ready_addr(server)
    assert addr is not None
    return lambda: GrpcTransport(addr)


def _http_connect(port: int, model: str) -> Callable[[ServerProcess], Callable[[], Transport]]:
    def connect(server: ServerProcess) -> Callable[[], Transport]:
        if not http_get_ok(f"http://{LOOPBACK}:{port}/health"):
            raise ServerError(f"{server.name} is READY but answers no HTTP /health on port {port}")
        return lambda: OpenAIHttpTransport(LOOPBACK, port, Path(model).name)

    return connect


def vllm_launch(args: argparse.Namespace, model: str) -> Launch:
    port = free_ports(1)[0]
    flags = [*common_flags(args), "--served-model-name", Path(model).name]
    flags += ["--seed", "0", "--disable-uvicorn-access-log"]
    health = vllm_is_ready(port)
    return Launch(
        "vllm",
        vllm_command(args.vllm_python, model, port, flags),
        VLLM_ENV,
        lambda server: health(),
        lambda server: lambda: OpenAIHttpTransport(LOOPBACK, port, Path(model).name),
    )


async def drive(
    make_transport: Callable[[], Transport],
    suite: Suite,
    wait_quiet: Callable[[int], float],
    server_pgid: int,
) -> dict[str, Any]:
    """Warm-up, then W1, W2 (repeats), W3, W3-burst on one running server; each timed
    workload starts once the machine is quiet (`wait_quiet`, which returns how busy it was),
    and records the CPU share other processes took while it ran."""
    transport = make_transport()
    summaries: dict[str, Any] = {}

    async def timed(workload: Workload) -> dict[str, float]:
        # Blocks the loop on purpose: nothing is in flight between workloads.
        busy = wait_quiet(server_pgid)
        others = OthersMeter(server_pgid)
        summary = summarize(*await run_workload(transport, workload))
        summary["others_cpu_share_before"] = busy
        summary["others_cpu_share"] = others.others_share()
        shown = {k: round(v, 2) for k, v in summary.items()}
        print(f"    {workload.name}: {json.dumps(shown)}")
        return summary

    try:
        summaries["warmup"] = summarize(*await run_workload(transport, suite.warmup))
        summaries["W1"] = await timed(suite.w1)
        summaries["W2"] = [await timed(w) for w in suite.w2_repeats]
        summaries["W3"] = await timed(suite.w3)
        summaries["W3-burst"] = await timed(suite.w3_burst)
    finally:
        await transport.aclose()
    return summaries


def run_one(
    launch: Launch, round_index: int, args: argparse.Namespace, suite: Suite
) -> dict[str, Any]:
    """Start one system, measure it, stop it by its process group (also on failure)."""
    log = BENCH_DIR / "peer-logs" / f"{launch.name}-round{round_index}.log"
    print(f"[round {round_index}] {launch.name}: {shell_line(launch.command, launch.env)}")

    def wait_quiet(pgid: int | None = None) -> float:  # the machine may be shared
        measure = functools.partial(others_busy_share, pgid)
        return wait_for_quiet(args.quiet_cpu_max, args.quiet_timeout, measure)

    busy = wait_quiet()
    server = start(launch.name, launch.command, log, launch.env)
    try:
        startup_s = wait_ready(server, lambda: launch.is_ready(server), args.startup_timeout)
        print(f"[round {round_index}] {launch.name}: ready in {startup_s:.1f} s")
        workloads = asyncio.run(
            drive(launch.connect(server), suite, wait_quiet, server.process.pid)
        )
    finally:
        stop(server)
    metrics = round_metrics(
        startup_s, workloads["W1"], workloads["W2"], workloads["W3"], workloads["W3-burst"]
    )
    return {
        "system": launch.name,
        "round": round_index,
        "command": server.command_line,
        "metrics": metrics,
        "workloads": workloads,
        "others_cpu_share_before_start": busy,
        "others_cpu_share_max": max_others_share(workloads),
    }


def _timed_runs(workloads: dict[str, Any]) -> list[dict[str, float]]:
    runs = [r for w in workloads.values() for r in (w if isinstance(w, list) else [w])]
    return [r for r in runs if "others_cpu_share" in r]


def max_others_share(workloads: dict[str, Any]) -> float:
    """The most CPU other processes took during any one timed workload (0..1)."""
    return max(r["others_cpu_share"] for r in _timed_runs(workloads))


def num_failed(record: dict[str, Any]) -> int:
    runs = [r for w in record["workloads"].values() for r in (w if isinstance(w, list) else [w])]
    return int(sum(r["failed"] for r in runs))


def write_results(path: Path, args: argparse.Namespace, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"platform": platform.platform(), "num_cpus": os.cpu_count()},
        "args": {k: str(v) for k, v in vars(args).items()},
        "rounds": records,
    }
    path.write_text(json.dumps(document, indent=2) + "\n")


def report(records: list[dict[str, Any]], output: Path) -> None:
    """The exact command lines, then the table of every system."""
    systems = list(dict.fromkeys(r["system"] for r in records))
    by_system = {name: [r for r in records if r["system"] == name] for name in systems}
    print("\nCommands (last round):")
    for name in systems:
        print(f"  {name}: {by_system[name][-1]['command']}")
    ours = {n: [r["metrics"] for r in by_system[n]] for n in systems if n != "vllm"}
    print(f"\n{render_systems_table(ours, [r['metrics'] for r in by_system['vllm']])}")
    print("\nCPU share other processes took during a timed workload (max per round):")
    for name in systems:
        shares = " / ".join(f"{r['others_cpu_share_max']:.0%}" for r in by_system[name])
        print(f"  {name}: {shares}")
    print(f"\nEvery round: {output}")


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Any of these ends the run through `finally`, which stops the running server's process
    # group (a background job starts with SIGINT ignored, so SIGTERM is the one that reaches it).
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _interrupt)
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)  # progress shows up in a piped log too
    if not Path(args.vllm_python).exists():
        print(f"no vLLM venv at {args.vllm_python}: run `make bench-peer`", file=sys.stderr)
        return 2
    model = args.model or str(ensure_bench_model())
    suite = build_suite(VOCAB_SIZE, args.seed, args.num_w2_repeats)
    launches: dict[str, Callable[[], Launch]] = {
        name: functools.partial(splitserve_launch, args, model, name, flags)
        for name, flags in splitserve_variants(args).items()
    }
    launches["vllm"] = functools.partial(vllm_launch, args, model)
    systems = list(launches)
    records: list[dict[str, Any]] = []
    try:
        for round_index in range(1, args.rounds + 1):
            order = systems if round_index % 2 else systems[::-1]
            for name in order:
                records.append(run_one(launches[name](), round_index, args, suite))
                write_results(args.output, args, records)
    except ServerError as err:
        print(f"bench-peer: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as interrupt:
        print(f"bench-peer: stopped by {interrupt or 'SIGINT'}; servers stopped", file=sys.stderr)
        return 130
    report(records, args.output)
    failed = sum(num_failed(r) for r in records)
    if failed:
        print(f"bench-peer: {failed} requests failed (see {args.output})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

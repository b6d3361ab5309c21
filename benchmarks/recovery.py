"""`python -m benchmarks.recovery`: the pause clients see when a worker rank or the engine core is
lost under load, and comes back (docs/reliability.md, Recovery).

A TP=2 stack on the tiny model (fp32), supervised as `splitserve up` supervises it (a child that
exits is started again, same port and flags). For each fault, 32 greedy streams of 64 tokens run;
once they are underway the fault is injected:

- rank_killed: SIGKILL of worker rank 1 (restarted by the supervisor; the core brings both ranks
  up again and resumes every request by recompute);
- rank_stopped: SIGSTOP of worker rank 0 until the core's step watchdog notices (its readiness
  turns NOT_SERVING), then SIGCONT;
- core_killed: SIGKILL of the engine core (restarted; the frontend resubmits its requests).

Reported per fault: `pause` = the longest gap between two tokens of any stream (what a client
sees), `recovery` = the core's splitserve_engine_recovery_seconds for it (from the fault's notice
to stepping again) or, for the core, from the kill to the frontend's resubmission, and whether
every stream finished with the undisturbed run's tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.children import Child, StackOptions, start_children, stop_children, wait_ready
from splitserve.supervisor import Supervisor
from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc
from splitserve_runtime.services import CORE
from splitserve_runtime.tiny_model import ensure_tiny_model

NUM_STREAMS, MAX_TOKENS = 32, 64


@dataclass
class Stream:
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    error: str = ""


def run_streams(addr: str, fault: Callable[[], None] | None) -> list[Stream]:
    streams = [Stream() for _ in range(NUM_STREAMS)]
    underway = threading.Event()
    channel = grpc.insecure_channel(addr)
    stub = gen_grpc.GenerationServiceStub(channel)

    def read(i: int) -> None:
        params = types_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        request = gen_pb2.GenerateRequest(prompt=f"stream {i} reads", sampling_params=params)
        try:
            for response in stub.Generate(request, timeout=600):
                streams[i].tokens += response.token_ids
                streams[i].times += [time.monotonic()] * len(response.token_ids)
                if len(streams[i].tokens) >= 8:
                    underway.set()
        except grpc.RpcError as err:
            streams[i].error = err.code().name

    threads = [threading.Thread(target=read, args=(i,)) for i in range(NUM_STREAMS)]
    for thread in threads:
        thread.start()
    if fault is not None:
        underway.wait(300)
        fault()
    for thread in threads:
        thread.join(600)
    channel.close()
    return streams


def metric(child: Child, name: str) -> float:
    with urllib.request.urlopen(child.metrics_url, timeout=10) as reply:
        lines = reply.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name))


def core_serving(core: Child) -> bool:
    try:
        with grpc.insecure_channel(core.address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=CORE.grpc_service), timeout=5
            )
    except grpc.RpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def max_gap(streams: list[Stream]) -> float:
    return max(
        (b - a for s in streams for a, b in zip(s.times, s.times[1:], strict=False)), default=0.0
    )


def faults(children: list[Child]) -> dict[str, Callable[[], None]]:
    by_name = {c.name: c for c in children}
    core = by_name["core"]

    def stop_rank() -> None:
        process = by_name["worker[0]"].process
        os.kill(process.pid, signal.SIGSTOP)
        try:
            while core_serving(core):
                time.sleep(0.05)
        finally:
            os.kill(process.pid, signal.SIGCONT)

    return {
        "rank_killed": lambda: by_name["worker[1]"].process.send_signal(signal.SIGKILL),
        "rank_stopped": stop_rank,
        "core_killed": lambda: core.process.send_signal(signal.SIGKILL),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="runs per fault")
    parser.add_argument("--json", action="store_true", help="print JSON lines")
    args = parser.parse_args()
    model = ensure_tiny_model()
    flags = ["--dtype", "float32", "--kv-cache-memory-bytes", str(64 << 20)]
    launch = StackOptions(
        str(model), tensor_parallel_size=2, http_port=-1, log_level="error",
        max_recovery_seconds=120.0, service_flags={"core": flags},
    )  # fmt: skip
    children = start_children(launch)
    supervisor = None
    try:
        wait_ready(children, 300)
        supervisor = Supervisor(children, report=lambda line: None).start()
        undisturbed = run_streams(children[-1].address, None)
        baseline = max_gap(undisturbed)
        print(f"undisturbed: longest gap between two tokens {baseline:.2f} s")
        for name, fault in faults(children).items():
            for _ in range(args.repeat):
                core = next(c for c in children if c.name == "core")
                before = metric(core, "splitserve_engine_recovery_seconds_sum")
                started = time.monotonic()
                streams = run_streams(children[-1].address, fault)
                identical = sum(
                    s.tokens == u.tokens for s, u in zip(streams, undisturbed, strict=True)
                )
                recovery = metric(core, "splitserve_engine_recovery_seconds_sum") - before
                result = {
                    "fault": name,
                    "pause_s": round(max_gap(streams), 2),
                    "recovery_s": round(recovery, 2) if name != "core_killed" else None,
                    "errors": sum(bool(s.error) for s in streams),
                    "identical": f"{identical}/{NUM_STREAMS}",
                    "run_s": round(time.monotonic() - started, 1),
                }
                print(json.dumps(result) if args.json else result, flush=True)
    finally:
        if supervisor is not None:
            supervisor.stop()
        stop_children(children)


if __name__ == "__main__":
    main()

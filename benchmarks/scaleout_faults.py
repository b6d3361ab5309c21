"""An engine lost under load behind the gateway (benchmarks/scaleout.py): one process of one of
`splitserve serve -dp N`'s engines (its engine core, or its worker rank 0) SIGKILLed while a
workload runs through the gateway; the launcher's supervisor starts it again with the same
ports and flags.

Counted: every request's outcome (benchmarks/scaleout_client.OUTCOMES: complete, error, truncated
or hung), the requests the engine was running at the kill, the seconds from the kill until the
engine serves again (a one-token probe sent to its own OpenAI server every 0.1 s is answered),
and the engine core's `vllm:kv_cache_usage_perc` once the run is over and the engine idle (it
must be 0: every block of every request freed, on the restarted core too).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from benchmarks.dp_serve import engine_metric, engine_pids
from benchmarks.peer_http import post_json
from benchmarks.scaleout_client import OUTCOMES, counters, outcome, run_sessions
from benchmarks.scaleout_targets import Target
from benchmarks.scaleout_workload import Workload
from splitserve.gateway_process import ready_engines_at
from splitserve_client.bench_serve import RequestResult

RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
SERVING_TIMEOUT_S = 300.0
IDLE_TIMEOUT_S = 60.0
RUNNING_WAIT_S = 10.0
"""After the delay, how long the kill waits for the engine to be running a request."""


@dataclass(frozen=True)
class FaultStats:
    """One engine process killed in the middle of one run."""

    fault: str
    """`core` or `worker` (rank 0)."""
    running_at_kill: float
    outcomes: dict[str, int]
    serving_again_s: float
    """From the SIGKILL until the engine answered a probe again (inf: not in 300 s)."""
    kv_usage_after: float
    """The engine core's KV-cache usage once the run is over and the engine idle."""


async def _metric(engine_http: str, name: str) -> float | None:
    try:
        return await asyncio.to_thread(engine_metric, engine_http, name)
    except (OSError, urllib.error.URLError):
        return None  # that frontend is restarting, or its core is


def _probe(engine_http: str, number: int) -> bool:
    """One one-token completion sent to the engine's own OpenAI server: True when it is served."""
    body = {"prompt": f"probe {number} {time.time()}", "max_tokens": 1, "temperature": 0.0}
    try:
        post_json(f"http://{engine_http}/v1/completions", body, timeout=10)
        return True
    except (OSError, urllib.error.URLError):
        return False  # 503 while its core is away, refused while its frontend restarts


async def _serving_again(engine_http: str, killed: float) -> float:
    """Seconds from `killed` until the engine serves a probe again (inf: not in 300 s)."""
    number = 0
    while time.monotonic() - killed < SERVING_TIMEOUT_S:
        number += 1
        if await asyncio.to_thread(_probe, engine_http, number):
            return time.monotonic() - killed
        await asyncio.sleep(0.1)
    return float("inf")


async def _kill_after(
    target: Target, engine: int, fault: str, delay_s: float
) -> tuple[float, float]:
    """SIGKILL `fault` of `engine` `delay_s` into the run, once it runs a request (or 10 s
    later); (the requests it was running, seconds until it serves again)."""
    assert target.serve is not None, "faults are injected into splitserve's own engines"
    await asyncio.sleep(delay_s)
    serve = target.serve
    http = serve.engine_http[engine]
    running = 0.0
    for _ in range(int(RUNNING_WAIT_S / 0.1)):  # killed while it is running a request
        running = await _metric(http, RUNNING) or 0.0
        if running:
            break
        await asyncio.sleep(0.1)
    pid = engine_pids(serve.server.process.pid, serve.engines[engine])[fault]
    os.kill(pid, signal.SIGKILL)
    return running, await _serving_again(http, time.monotonic())


def wait_routable(gateway_http: str, num_engines: int) -> float:
    """Seconds until the gateway's /readiness counts every engine healthy again."""
    started = time.monotonic()
    while time.monotonic() - started < SERVING_TIMEOUT_S:
        if ready_engines_at(f"http://{gateway_http}/readiness") >= num_engines:
            return time.monotonic() - started
        time.sleep(0.2)
    raise TimeoutError(f"the gateway at {gateway_http} routes to fewer than {num_engines} engines")


def wait_idle_usage(metrics_url: str) -> float:
    """The engine core's KV-cache usage once it reaches 0 (or its last value after 60 s)."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    usage = float("nan")
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, urllib.error.URLError):  # a restarted core's port
            usage = counters([metrics_url], [KV_USAGE])[KV_USAGE]
        if usage == 0.0:
            break
        time.sleep(0.5)
    return usage


async def _run(
    target: Target, model: str, workload: Workload, engine: int, fault: str, delay_s: float
) -> tuple[list[RequestResult], float, tuple[float, float]]:
    kill = asyncio.create_task(_kill_after(target, engine, fault, delay_s))
    results, wall_s = await run_sessions(f"http://{target.http}", model, workload)
    return results, wall_s, await kill


def run_with_fault(
    target: Target, model: str, workload: Workload, engine: int, fault: str, delay_s: float
) -> tuple[list[RequestResult], float, FaultStats]:
    """`workload` through the gateway with `fault` of `engine` killed `delay_s` into it."""
    results, wall_s, (running, back_s) = asyncio.run(
        _run(target, model, workload, engine, fault, delay_s)
    )
    counts = collections.Counter(outcome(r) for r in results)
    usage = wait_idle_usage(target.metrics_urls[engine])
    stats = FaultStats(fault, running, {o: counts[o] for o in OUTCOMES}, back_s, usage)
    print(f"    {fault} of engine {engine} killed {delay_s:g} s into {workload.name}: {stats}",
          flush=True)  # fmt: skip
    return results, wall_s, stats

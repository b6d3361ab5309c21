"""`python -m benchmarks.dp_failover`: what clients of `splitserve serve -dp 2` see through the
gateway when a process of one engine dies under load (docs/deploy.md, "Data parallel").

Starts `splitserve serve MODEL --data-parallel-size 2 --router ROUTER` (the real smg gateway in
front of two engines), then for each fault runs a closed loop of chat completions through the
gateway (half streamed, all `ignore_eos` with a fixed `max_tokens`) and, once a few have finished,
SIGKILLs one process of engine 1 (the launcher restarts it: same port and flags):

- core: engine 1's engine core (its frontend resubmits the requests it holds to the new core);
- worker: engine 1's worker rank 0 (the core suspends, brings the restarted rank up, resumes);
- frontend: engine 1's frontend (the gRPC streams the gateway had open on it break).

Every request ends in one of: `complete` (all `max_tokens` tokens, finish_reason "length"),
`error` (an HTTP error status, or a stream that ends with an error event or a broken connection:
the client knows, and may retry), or `truncated` (a normal end with fewer tokens, or no
finish_reason: a silent loss). After each fault the gateway must route to both engines again
before the next one.
"""

from __future__ import annotations

import argparse
import collections
import functools
import itertools
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import openai

from benchmarks.dp_serve import Serve, engine_metric, engine_pids, start_serve
from benchmarks.peer_servers import stop
from splitserve.gateway_process import NO_ROUTER

FAULTS = ("core", "worker", "frontend")
OUTCOMES = ("complete", "error", "truncated")
WORDS = "river stone light window garden music paper water bright quiet early field".split()
LOG_DIR = Path(".bench") / "dp-failover-logs"
PROBE_IDS = itertools.count(1)
"""Probe requests' indices (negative: apart from the load's), never the same prompt twice."""


def kill_engine_process(serve: Serve, engine: int, kind: str, running: list[float]) -> None:
    """SIGKILL one process of `engine`; appends the requests it was running to `running`."""
    pid = engine_pids(serve.server.process.pid, serve.engines[engine])[kind]
    running.append(engine_metric(serve.engine_http[engine], "vllm:num_requests_running"))
    os.kill(pid, signal.SIGKILL)


def one_request(client: openai.OpenAI, model: str, i: int, max_tokens: int) -> str:
    """One chat completion (streamed when i is odd): its outcome."""
    body = {
        "model": model,
        "messages": [
            {"role": "user", "content": f"{i} " + " ".join(random.Random(i).choices(WORDS, k=12))}
        ],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "extra_body": {"ignore_eos": True},
    }
    try:
        if i % 2:
            finish, num_tokens = None, 0
            stream = client.chat.completions.create(  # type: ignore[call-overload]
                **body, stream=True, stream_options={"include_usage": True}
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if chunk.usage is not None:
                    num_tokens = chunk.usage.completion_tokens
        else:
            reply = client.chat.completions.create(**body)  # type: ignore[call-overload]
            finish, num_tokens = reply.choices[0].finish_reason, reply.usage.completion_tokens
    except (openai.APIError, openai.APIConnectionError):
        return "error"
    return "complete" if finish == "length" and num_tokens == max_tokens else "truncated"


def run_load(
    url: str,
    model: str,
    num_requests: int,
    concurrency: int,
    max_tokens: int,
    fault: Callable[[], None] | None = None,
    fault_after: int = 4,
) -> collections.Counter[str]:
    """A closed loop of `num_requests` through the gateway; `fault` runs once `fault_after`
    requests have finished. Returns the outcomes' counts."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=300)
    counts: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    indices = iter(range(num_requests))
    fired = threading.Event()

    def loop() -> None:
        for i in indices:
            outcome = one_request(client, model, i, max_tokens)
            with lock:
                counts[outcome] += 1
                counts[f"{outcome}, streamed"] += i % 2
                due = fault is not None and not fired.is_set() and counts.total() >= fault_after
                if due:
                    fired.set()
            if due:
                assert fault is not None
                fault()

    threads = [threading.Thread(target=loop) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return counts


def wait_serving(
    serve: Serve, engine: int, client: openai.OpenAI, model: str, timeout: float = 300.0
) -> float:
    """Seconds until `engine` finishes requests sent through the gateway again (probes of one
    token each, sent until its frontend counts one more success)."""
    started = time.monotonic()
    name = "vllm:request_success_total"
    while time.monotonic() - started < timeout:
        try:
            before = engine_metric(serve.engine_http[engine], name)
            for _ in range(4):  # new prompts each time: a cache-aware gateway sends a prompt
                # it has seen to the engine that cached it, never to the restarted one
                one_request(client, model, -next(PROBE_IDS), 1)
            if engine_metric(serve.engine_http[engine], name) > before:
                return time.monotonic() - started
        except OSError:
            pass  # its frontend is still restarting
        time.sleep(0.5)
    raise TimeoutError(f"engine {engine} takes no requests through the gateway")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dp_failover", description=__doc__)
    p.add_argument("--model", default="tiny")
    p.add_argument("--router", default="round_robin", help="round_robin: half the load on engine 1")
    p.add_argument("--faults", default=",".join(FAULTS), help="comma-separated, of " + str(FAULTS))
    p.add_argument("--requests", type=int, default=48, help="per fault")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--serve-flags", default="", help="more `splitserve serve` flags")
    args = p.parse_args(argv)
    assert args.router != NO_ROUTER, "the measurement is through the gateway"
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    serve = start_serve(
        args.model, args.router, args.serve_flags.split(), LOG_DIR / "serve.log", 900.0
    )
    url = f"http://{serve.http}"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    rows = []
    try:
        for fault in args.faults.split(","):
            held: list[float] = []
            kill = functools.partial(kill_engine_process, serve, 1, fault, held)
            wait_serving(serve, 1, client, model)
            counts = run_load(url, model, args.requests, args.concurrency, args.max_tokens, kill)
            back = wait_serving(serve, 1, client, model)
            rows.append((fault, held[0], counts, back))
            print(f"{fault} killed with {held[0]:.0f} requests running on engine 1: "
                  f"{dict(counts)}; engine 1 served again {back:.1f} s after the load")  # fmt: skip
    finally:
        stop(serve.server)
    cols = " | ".join(f"{o} (streamed)" for o in OUTCOMES)
    print(f"\n| killed (engine 1) | running on it at the kill | {cols} |")
    print("|---|---|" + "---|" * len(OUTCOMES))
    for fault, running, counts, _ in rows:
        cells = " | ".join(f"{counts[o]} ({counts[f'{o}, streamed']})" for o in OUTCOMES)
        print(f"| {fault} | {running:.0f} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

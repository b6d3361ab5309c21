"""worker_svc entry point: parse flags once, serve WorkerService until SIGTERM."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from splitserve_contracts.kv.v1 import kv_transfer_pb2 as kv_pb
from splitserve_contracts.worker.v1 import worker_service_pb2_grpc as worker_grpc
from splitserve_runtime.channels import ChannelSecurity
from splitserve_runtime.listener import internal_listener
from splitserve_runtime.log_config import configure_logging
from splitserve_runtime.services import WORKER
from splitserve_runtime.sync_service_host import SyncServiceHost
from splitserve_runtime.tls import CORE_ROLE, WORKER_ROLE
from splitserve_runtime.tracing import start_tracing
from worker_svc.config import WorkerConfig, parse_config
from worker_svc.cpu_binding import OMP_THREADS_BIND_ENV

logger = logging.getLogger(__name__)
KV_TRANSFER_SERVICE = kv_pb.DESCRIPTOR.services_by_name["KvTransferService"].full_name
"""Served once a KV connector is configured; only other engines' ranks may call it."""


def serve(config: WorkerConfig) -> int:
    import torch

    from worker_svc.cpu_binding import CpuBinding
    from worker_svc.kv_connector.rank_connector import RankKvConnector
    from worker_svc.server import WorkerServicer
    from worker_svc.stream.stall_watch import StallWatch

    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    host = SyncServiceHost(
        name="worker",
        host=config.host,
        port=config.port,
        service_names=[WORKER.grpc_service],
        metrics_port=config.metrics_port,
        grace_seconds=config.shutdown_timeout,  # the core's Execute stream keeps running
        # Only the engine core may call a worker, and only another engine's ranks its KV
        # (health: any peer of the same CA).
        listener=internal_listener(
            tls=config.tls,
            allowed_roles={
                WORKER.grpc_service: frozenset({CORE_ROLE}),
                KV_TRANSFER_SERVICE: frozenset({WORKER_ROLE}),
            },
            enable_reflection=config.enable_reflection,
            health_port=config.health_port,
            secret=config.internal_secret,
        ),
    )
    kv = RankKvConnector(ChannelSecurity(config.tls, WORKER_ROLE, config.internal_secret))
    tracing = start_tracing("worker", config.otlp_traces_endpoint, config.collect_detailed_traces)
    servicer = WorkerServicer(
        host.registry,
        StallWatch(host.set_ready),
        device=config.device,
        profiler_config=config.profiler_config,
        tracing=tracing,
        cpu_binding=CpuBinding.from_environ(
            {OMP_THREADS_BIND_ENV: config.omp_threads_bind}, config.torch_threads
        ),
        kv=kv,
    )
    worker_grpc.add_WorkerServiceServicer_to_server(servicer, host.server)
    host.server.add_generic_rpc_handlers((kv.services,))
    host.start()
    # A worker is ready as soon as it can take the core's start-up calls.
    host.set_ready(True)
    code = host.run_until_stopped(on_shutdown=servicer.close)
    if tracing is not None:
        tracing.shutdown()  # the spans still batched
    return code


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    configure_logging(config.log_level, "worker", config.log_format)
    return serve(config)

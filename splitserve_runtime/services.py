"""The three services, stated once: their gRPC service names (read from the contracts, so they
cannot drift) and their default ports. Flags, the launcher, health checks and docs use these."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve_contracts.core.v1 import core_service_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2
from splitserve_contracts.worker.v1 import worker_service_pb2


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    """One service: its role name, the gRPC service whose readiness it reports, its ports."""

    kind: str
    grpc_service: str
    default_port: int
    default_metrics_port: int


FRONTEND = ServiceSpec(
    "frontend",
    generation_service_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name,
    default_port=50051,
    default_metrics_port=9400,
)
CORE = ServiceSpec(
    "core",
    core_service_pb2.DESCRIPTOR.services_by_name["EngineCoreService"].full_name,
    default_port=50061,
    default_metrics_port=9401,
)
WORKER = ServiceSpec(
    "worker",
    worker_service_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name,
    default_port=50071,
    default_metrics_port=9402,
)
SERVICES = {spec.kind: spec for spec in (FRONTEND, CORE, WORKER)}
"""By role name: "frontend", "core", "worker"."""

OWNER_EPOCH_METADATA_KEY = "x-splitserve-owner-epoch"
"""gRPC metadata key of the engine core's ownership epoch on its calls to a worker after
LoadModel (GetKvCapacity, InitializeKvCache, Execute); see worker_svc/ownership.py."""

INTERNAL_SECRET_METADATA_KEY = "x-splitserve-internal-secret"
"""gRPC metadata key of the deployment's internal secret (--internal-secret), which the frontends
present to the core and the core to the workers; see splitserve_runtime/rpc_guard.py."""

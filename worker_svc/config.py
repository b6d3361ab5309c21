"""worker_svc configuration: flags with SPLITSERVE_* environment fallbacks."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from splitserve_runtime.flags import Flag, FlagParser, flag, non_negative_int
from splitserve_runtime.log_config import LOGGING_FLAGS
from splitserve_runtime.profiler_config import PROFILER_FLAGS, ProfilerConfig
from splitserve_runtime.services import WORKER
from splitserve_runtime.tracing import TRACING_FLAGS
from splitserve_runtime.transport_flags import (
    LOOPBACK,
    TransportConfig,
    check_internal_tls,
    internal_tls_flags,
    listener_flags,
    optional_port,
)
from splitserve_runtime.vllm_compat import NO_EFFECT_FLAGS
from worker_svc.cpu_binding import OMP_THREADS_BIND_ENV, check_bind

DEFAULT_PORT = WORKER.default_port
DEFAULT_METRICS_PORT = WORKER.default_metrics_port


@dataclass(frozen=True)
class WorkerConfig(TransportConfig):
    """Everything worker_svc needs at start-up; what to load arrives later in LoadModel."""

    host: str = LOOPBACK
    port: int = DEFAULT_PORT
    metrics_port: int | None = DEFAULT_METRICS_PORT
    device: str = "auto"
    torch_threads: int = 0
    omp_threads_bind: str = "all"
    """VLLM_CPU_OMP_THREADS_BIND from the environment (worker_svc/cpu_binding.py)."""
    shutdown_timeout: float = 30.0
    log_level: str = "info"
    log_format: str = "text"
    profiler_config: ProfilerConfig = field(default_factory=ProfilerConfig)
    otlp_traces_endpoint: str = ""
    collect_detailed_traces: list[str] = field(default_factory=list)


WORKER_FLAGS: tuple[Flag, ...] = (
    flag(
        "--host",
        default=LOOPBACK,
        help="address to listen on (in a pod: its IP, from the downward API)",
    ),
    flag("--port", type=non_negative_int, default=DEFAULT_PORT, help="gRPC port"),
    flag(
        "--metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORT,
        help="Prometheus /metrics port (-1 disables)",
    ),
    flag(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where the model runs (auto: cuda when available)",
    ),
    flag(
        "--torch-threads",
        type=non_negative_int,
        default=0,
        help="CPU threads for torch (0: torch's default)",
    ),
    flag(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds the engine core's open step stream may keep running (new calls "
        "are refused), so that a core stopping at the same time can finish its own drain; the "
        "worker exits as soon as that stream ends",
    ),
    *LOGGING_FLAGS,
    *internal_tls_flags("the port the engine core calls"),
    *listener_flags(reflection_default=False),
    *PROFILER_FLAGS,
    *TRACING_FLAGS,
    *NO_EFFECT_FLAGS,
)
"""The flags of `splitserve worker`."""


def build_parser() -> FlagParser:
    return FlagParser.of_service(
        "splitserve worker",
        "Run one worker rank; the engine core tells it what to load.",
        WORKER_FLAGS,
    )


def parse_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> WorkerConfig:
    parser = build_parser()
    environ = os.environ if environ is None else environ
    args = parser.parse(argv, environ)
    check_internal_tls(parser, args)
    values = vars(args)
    try:
        values["omp_threads_bind"] = check_bind(environ.get(OMP_THREADS_BIND_ENV, "all").strip())
    except ValueError as e:
        parser.error(str(e))
    values.pop("config", None)
    values["metrics_port"] = None if args.metrics_port < 0 else args.metrics_port
    values["health_port"] = optional_port(args.health_port)
    return WorkerConfig(**values)

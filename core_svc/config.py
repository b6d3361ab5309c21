"""core_svc configuration: vLLM-named flags (core_flags.py) with SPLITSERVE_* environment
fallbacks, parsed and checked into a CoreConfig."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Self

from core_svc.core_flags import CORE_FLAGS, DEFAULT_METRICS_PORT, DEFAULT_PORT
from core_svc.kv_connector.factory import kv_connector_settings_problem, with_kv_engine_id
from core_svc.lora import LoraModule
from core_svc.sched.scheduler_config import DEFAULT_MAX_NUM_BATCHED_TOKENS_PER_RANK
from splitserve_contracts.engine_options_types import FIELD_GROUP, EngineOptions
from splitserve_contracts.spec_decode import SpeculativeConfig
from splitserve_runtime.engine_option_rules import (
    engine_options,
    lora_options,
    validate,
    world_size,
)
from splitserve_runtime.flags import FlagParser, filled_options
from splitserve_runtime.model_spec import canonical_dtype
from splitserve_runtime.profiler_config import ProfilerConfig
from splitserve_runtime.quantization_names import canonical_quantization
from splitserve_runtime.transport_flags import (
    LOOPBACK,
    TransportConfig,
    check_internal_tls,
    optional_port,
)


@dataclass(frozen=True)
class CoreConfig(TransportConfig):
    """Everything core_svc needs, parsed once at start-up: the engine's options (the record the
    ranks receive, common.v1.EngineOptions) and the core's own settings."""

    options: EngineOptions = field(default_factory=EngineOptions)
    worker_addrs: list[str] = field(default_factory=list)
    served_model_name: str = ""
    host: str = LOOPBACK
    port: int = DEFAULT_PORT
    metrics_port: int | None = DEFAULT_METRICS_PORT
    engine_id: str = "0"
    worker_connect_timeout: float = 600.0
    execute_timeout: float = 300.0
    step_timeout_floor: float = 5.0
    step_timeout_multiple: float = 10.0
    shutdown_timeout: float = 30.0
    max_recovery_seconds: float = 120.0
    speculative_config: SpeculativeConfig | None = None
    """--speculative-config with the core's own per-batch-size schedule (options.speculative is
    what the ranks get of it)."""
    lora_modules: list[LoraModule] = field(default_factory=list)
    log_stats_interval: float = 10.0
    log_level: str = "info"
    log_format: str = "text"
    profiler_config: ProfilerConfig = field(default_factory=ProfilerConfig)
    otlp_traces_endpoint: str = ""
    collect_detailed_traces: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, **values: Any) -> Self:
        """A config from flat names, engine options among them (`CoreConfig.of(model="m",
        block_size=16, engine_id="1")`: tests, benchmarks)."""
        named = {name: values.pop(name) for name in list(values) if name in FIELD_GROUP}
        return cls(options=engine_options(named), **values)

    @property
    def model(self) -> str:
        return self.options.model.model

    @property
    def world_size(self) -> int:
        return world_size(self.options)


def build_parser() -> FlagParser:
    return FlagParser.of_service(
        "splitserve core", "Run the engine core service (vLLM's P1).", CORE_FLAGS
    )


def parse_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> CoreConfig:
    """Parse flags (falling back to SPLITSERVE_* variables) into a CoreConfig."""
    parser = build_parser()
    args = parser.parse(argv, os.environ if environ is None else environ)
    world = args.tensor_parallel_size * args.pipeline_parallel_size
    if args.worker_addrs and len(args.worker_addrs) != world:
        parser.error(
            f"--worker-addrs lists {len(args.worker_addrs)} workers but "
            f"--tp {args.tensor_parallel_size} x --pp {args.pipeline_parallel_size} "
            f"needs {world}"
        )
    if not args.worker_addrs:
        parser.error("--worker-addrs is required (HOST:PORT of every worker rank)")
    if args.max_recovery_seconds < 0:
        parser.error("--max-recovery-seconds must be >= 0")
    if args.async_scheduling is None:
        args.async_scheduling = args.pipeline_parallel_size == 1
    check_internal_tls(parser, args)
    if args.log_stats_interval < 0:
        parser.error("--log-stats-interval must be >= 0")
    values = vars(args)
    values.pop("config", None)
    values["health_port"] = optional_port(args.health_port)
    values["dtype"] = canonical_dtype(args.dtype)
    values["served_model_name"] = (args.served_model_name or [""])[0]
    values["quantization"] = canonical_quantization(args.quantization)
    if values.pop("disable_log_stats"):
        values["log_stats_interval"] = 0.0
    lora_on = _lora_values(parser, values)
    if args.max_num_batched_tokens is None:
        values["max_num_batched_tokens"] = DEFAULT_MAX_NUM_BATCHED_TOKENS_PER_RANK * world
    values["metrics_port"] = None if args.metrics_port < 0 else args.metrics_port
    if not args.distributed_init_method:
        host = args.worker_addrs[0].rsplit(":", 1)[0]
        values["distributed_init_method"] = f"tcp://{host}:29500"
    values["options"] = _options(parser, values, lora_on)
    problem = kv_connector_settings_problem(values["options"], args.worker_addrs)
    if problem is not None:
        parser.error(f"--kv-transfer-config: {problem}")
    return CoreConfig(**values)


def _options(parser: FlagParser, values: dict[str, Any], lora_on: bool) -> EngineOptions:
    """The engine options the flags filled (taken out of `values`), checked by the rules the
    ranks apply to LoadModel; a refusal names the flag and the field. A KV connector's engine
    id is chosen here when the flags leave it "", so the ranks get the core's."""
    spec = values["speculative_config"]
    options = engine_options(filled_options(CORE_FLAGS, values))
    options = replace(options, lora=lora_options(lora_on, options.lora))
    values["speculative_config"] = spec
    try:
        return with_kv_engine_id(validate(options))
    except ValueError as err:
        path = getattr(err, "field", "")
        rows = [row for row in CORE_FLAGS if row.fills and f"{path}.".startswith(f"{row.fills}.")]
        flag = rows[0].names[0] if rows else ""
        parser.error(f"{flag}: {err}" if flag else str(err))


def _lora_values(parser: FlagParser, values: dict[str, Any]) -> bool:
    """Whether --enable-lora was given (taken out of `values`; the rules' lora_options fills
    the LoRA group from it), once the adapters to load at start-up fit it."""
    if not values.pop("enable_lora"):
        if values["lora_modules"]:
            parser.error("--lora-modules needs --enable-lora")
        return False
    names = [m.name for m in values["lora_modules"]]
    if len(set(names)) != len(names):
        parser.error("--lora-modules names an adapter twice")
    return True

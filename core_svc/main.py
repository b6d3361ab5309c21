"""core_svc entry point: parse flags once, bring the workers up, build the service (the engine
itself: core_svc/assembly.py), run the busy loop, serve."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry

from core_svc import convert
from core_svc.assembly import build_engine, served_model_name
from core_svc.config import CoreConfig, parse_config
from core_svc.engine.engine_inbox import EngineInbox
from core_svc.engine.engine_loop import EngineCoreProc
from core_svc.lora import LoraError, LoraRegistry
from core_svc.lora_admin import LoraAdmin
from core_svc.metrics import CoreMetrics
from core_svc.recovery import RankRecovery
from core_svc.server import ClientStreams, EngineCoreServicer
from core_svc.stats_logger import StatsLogger, log_stats_every
from core_svc.tracing import CoreTracer
from core_svc.worker_pool import ModelFacts, WorkerBringUpError, WorkerPool, kv_sizing_reason
from splitserve_contracts.core.v1 import core_service_pb2 as core_pb2
from splitserve_contracts.core.v1 import core_service_pb2_grpc as core_grpc
from splitserve_runtime.channels import ChannelSecurity
from splitserve_runtime.engine_option_rules import lora_enabled
from splitserve_runtime.grpc_client_metrics import GrpcClientMetrics
from splitserve_runtime.listener import internal_listener
from splitserve_runtime.log_config import configure_logging
from splitserve_runtime.service_host import ServiceHost, new_registry
from splitserve_runtime.services import CORE
from splitserve_runtime.termination import report_fatal
from splitserve_runtime.tls import FRONTEND_ROLE, WORKER_ROLE
from splitserve_runtime.tracing import start_tracing

logger = logging.getLogger(__name__)
GIB = 1024**3


def log_kv_cache(config: CoreConfig, facts: ModelFacts, info: core_pb2.EngineInfo) -> None:
    block_size = config.options.cache.block_size
    tokens = (facts.num_kv_blocks - 1) * block_size
    logger.info(
        "model %s (%s, %s, attention %s): max_model_len %d, vocab %d",
        info.served_model_name,
        facts.architecture,
        facts.dtype,
        facts.attention_backend,
        facts.max_model_len,
        facts.vocab_size,
    )
    logger.info(
        "KV cache: %d blocks x %d tokens, %.2f GiB per rank, sized by %s",
        facts.num_kv_blocks,
        block_size,
        facts.kv_cache_bytes_per_rank / GIB,
        kv_sizing_reason(config, facts),
    )
    logger.info(  # vLLM's wording: operators grep for it
        "%s KV cache size: %d tokens, Maximum concurrency for %d tokens per request: %.2fx",
        "CPU" if facts.device_type == "cpu" else "GPU",
        tokens,
        facts.max_model_len,
        info.max_concurrency,
    )
    if facts.sliding_window:
        logger.info(
            "every layer attends within a %d-token sliding window: KV blocks out of it are "
            "freed while requests run",
            facts.sliding_window,
        )


def cache_config_labels(config: CoreConfig, facts: ModelFacts) -> dict[str, str]:
    """Labels of vllm:cache_config_info (vLLM's CacheConfig field names)."""
    return {
        "engine": config.engine_id,
        "block_size": str(config.options.cache.block_size),
        "cache_dtype": config.options.cache.kv_cache_dtype,
        "enable_prefix_caching": str(
            facts.serves_prefix_caching(config.options.cache.enable_prefix_caching)
        ),
        "gpu_memory_utilization": str(config.options.cache.gpu_memory_utilization),
        "num_gpu_blocks": str(facts.num_kv_blocks),
        "kv_cache_memory_bytes": str(facts.kv_cache_bytes_per_rank),
    }


class CoreService:
    """The engine core service, built complete once the ranks' facts are known (as vLLM's
    engine brings its workers up before serving): the gRPC host, the metrics, the rank recovery
    that owns the executors, the busy loop and the servicer. Build it on the serving loop."""

    def __init__(
        self,
        config: CoreConfig,
        pool: WorkerPool,
        facts: ModelFacts,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.config = config
        self.info = convert.engine_info_to_proto(config, facts, served_model_name(config))
        self.facts = facts
        log_kv_cache(config, facts, self.info)
        if config.options.scheduler.async_scheduling:  # vLLM's wording
            logger.info("Asynchronous scheduling is enabled (--no-async-scheduling: lockstep)")
        if config.speculative_config is not None:
            spec = config.speculative_config
            logger.info(
                "Speculative decoding: %s, up to %d draft tokens per request (n-gram %d..%d, "
                "proposed by the worker ranks)",
                spec.method,
                spec.num_speculative_tokens,
                spec.prompt_lookup_min,
                spec.prompt_lookup_max,
            )
        self.host = service_host(config, registry)
        self.metrics = CoreMetrics(
            self.host.registry,
            self.info.served_model_name,
            config.engine_id,
            cache_config_labels(config, facts),
            config.speculative_config.num_speculative_tokens if config.speculative_config else 0,
        )
        self._loop = asyncio.get_running_loop()
        inbox = EngineInbox()
        self.recovery = RankRecovery(config, pool, inbox, self.metrics, facts, self.host.set_ready)
        streams = ClientStreams(self._loop)
        loras = LoraRegistry(lora_enabled(config.options.lora), self.info.served_model_name)
        self.loras = LoraAdmin(loras, pool, inbox)
        self.tracing = start_tracing(
            "core", config.otlp_traces_endpoint, config.collect_detailed_traces
        )
        tracer = CoreTracer(self.tracing, config.engine_id) if self.tracing else None
        engine = build_engine(config, facts, self.recovery.executor, inbox)
        grammars = engine.structured.manager
        self.metrics.watch_structured_outputs(
            lambda: (grammars.num_cache_queries, grammars.num_cache_hits)
        )
        self.proc = EngineCoreProc(
            engine,
            inbox,
            streams.deliver,
            on_stats=self.metrics.observe_stats,
            on_failed=self._engine_failed,
            on_suspended=self.recovery.on_suspended,
            on_traced=tracer.on_finished if tracer is not None else None,
        )
        self.servicer = EngineCoreServicer(
            self.proc,
            streams,
            self.info,
            self.metrics,
            config.profiler_config.is_enabled,
            is_tracing=tracer is not None,
            loras=self.loras,
        )
        core_grpc.add_EngineCoreServiceServicer_to_server(self.servicer, self.host.server)

    def _engine_failed(self, message: str) -> None:
        """The loop thread, the failure's outputs already sent: the service exits."""
        loop, reason = self._loop, f"engine failed: {message}; exiting"
        loop.call_soon_threadsafe(lambda: loop.create_task(self.host.fail(reason)))

    async def run(self) -> int:
        """Step and serve until stopped; returns the exit code."""
        gc.collect()
        gc.freeze()  # the block pool's objects are long-lived: keep them out of GC passes
        self.proc.start()
        try:
            await self.loras.load_modules(self.config.lora_modules)
        except LoraError as err:
            report_fatal("core", str(err))
            await asyncio.to_thread(self.proc.stop, 10.0)
            return 1
        await self.host.start()
        await self.host.set_ready(True)
        stats_task = None
        if self.config.log_stats_interval > 0:
            stats_logger = StatsLogger(
                self.config.engine_id, self.facts.device_type, time.monotonic()
            )
            stats_task = asyncio.create_task(
                log_stats_every(
                    self.config.log_stats_interval, stats_logger, lambda: self.proc.latest_stats
                )
            )
        code = await self.host.run_until_stopped(on_shutdown=self._drain)
        await self.recovery.close()
        if stats_task is not None:
            stats_task.cancel()
        await asyncio.to_thread(self.proc.stop, 10.0)
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)  # the spans still batched
        return code

    async def _drain(self) -> None:
        await drain_engine(self.proc, self.config.shutdown_timeout)
        await self.servicer.close_streams()


def service_host(config: CoreConfig, registry: CollectorRegistry | None = None) -> ServiceHost:
    """The gRPC host: only frontends may call the core (health: any peer of the same CA)."""
    return ServiceHost(
        name="core",
        host=config.host,
        port=config.port,
        service_names=[CORE.grpc_service],
        metrics_port=config.metrics_port,
        grace_seconds=config.shutdown_timeout + 5.0,
        listener=internal_listener(
            tls=config.tls,
            allowed_roles={CORE.grpc_service: frozenset({FRONTEND_ROLE})},
            enable_reflection=config.enable_reflection,
            health_port=config.health_port,
            secret=config.internal_secret,
        ),
        registry=registry,
    )


async def serve(config: CoreConfig) -> int:
    """Bring the workers up first, then build the service complete and serve."""
    registry = new_registry()
    pool = WorkerPool(
        config.worker_addrs,
        ChannelSecurity(config.tls, WORKER_ROLE, config.internal_secret),
        grpc_metrics=GrpcClientMetrics(registry),
    )
    try:
        try:
            facts = await pool.bring_up_with_retries(config, served_model_name(config))
        except WorkerBringUpError as err:
            report_fatal("core", str(err))
            return 1
        return await CoreService(config, pool, facts, registry).run()
    finally:
        await pool.close()


async def drain_engine(proc: EngineCoreProc, timeout: float) -> None:
    """Refuse new requests, let the running ones finish for up to `timeout` seconds, then end
    the rest with an error (vLLM's --shutdown-timeout)."""
    proc.inbox.drain()
    deadline = time.monotonic() + timeout
    while not proc.is_idle and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if not proc.is_idle:
        logger.warning("shutdown: %.0f s passed; aborting the requests still running", timeout)
        proc.inbox.abort_all()
        await asyncio.sleep(0.2)  # let the aborts reach their streams


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    configure_logging(config.log_level, "core", config.log_format)
    return asyncio.run(serve(config))

"""core_svc entry point: parse flags once, bring the workers up, run the busy loop, serve."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Sequence

from core_svc.config import CoreConfig, parse_config
from core_svc.engine_core import EngineCore, Fault
from core_svc.engine_loop import EngineCoreProc
from core_svc.executor import Executor
from core_svc.grpc_executor import GrpcExecutor
from core_svc.metrics import CoreMetrics
from core_svc.recovery import RankRecovery
from core_svc.scheduler_config import CacheConfig, SchedulerConfig
from core_svc.server import ClientStreams, EngineCoreServicer
from core_svc.stats_logger import StatsLogger, log_stats_every
from core_svc.step_budget import StepBudget
from core_svc.worker_pool import ModelFacts, WorkerBringUpError, WorkerPool, kv_sizing_reason
from splitserve_contracts.core.v1 import core_service_pb2 as core_pb2
from splitserve_contracts.core.v1 import core_service_pb2_grpc as core_grpc
from splitserve_runtime.channels import ChannelSecurity
from splitserve_runtime.listener import internal_listener
from splitserve_runtime.log_config import configure_logging
from splitserve_runtime.model_spec import served_model_name as default_served_name
from splitserve_runtime.service_host import ServiceHost
from splitserve_runtime.services import CORE
from splitserve_runtime.termination import report_fatal
from splitserve_runtime.tls import FRONTEND_ROLE, WORKER_ROLE

logger = logging.getLogger(__name__)
GIB = 1024**3


def served_model_name(config: CoreConfig) -> str:
    return config.served_model_name or default_served_name(config.model)


def engine_info(config: CoreConfig, facts: ModelFacts) -> core_pb2.EngineInfo:
    usable_tokens = (facts.num_kv_blocks - 1) * config.block_size  # block 0 is the null block
    return core_pb2.EngineInfo(
        served_model_name=served_model_name(config),
        model_path=config.model,
        max_model_len=facts.max_model_len,
        vocab_size=facts.vocab_size,
        block_size=config.block_size,
        num_kv_blocks=facts.num_kv_blocks,
        tensor_parallel_size=config.tensor_parallel_size,
        pipeline_parallel_size=config.pipeline_parallel_size,
        dtype=facts.dtype,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        enable_prefix_caching=config.enable_prefix_caching,
        engine_id=config.engine_id,
        max_concurrency=usable_tokens / facts.max_model_len,
        max_tokens_per_mm_item=facts.max_tokens_per_mm_item,
    )


def log_kv_cache(config: CoreConfig, facts: ModelFacts, info: core_pb2.EngineInfo) -> None:
    tokens = (facts.num_kv_blocks - 1) * config.block_size
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
        config.block_size,
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
        "block_size": str(config.block_size),
        "cache_dtype": "auto",
        "enable_prefix_caching": str(config.enable_prefix_caching),
        "gpu_memory_utilization": str(config.gpu_memory_utilization),
        "num_gpu_blocks": str(facts.num_kv_blocks),
        "kv_cache_memory_bytes": str(facts.kv_cache_bytes_per_rank),
    }


def build_engine(config: CoreConfig, facts: ModelFacts, executor: Executor) -> EngineCore:
    scheduler = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=facts.max_model_len,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        prefill_token_budget=config.prefill_token_budget,
        policy=config.scheduling_policy,  # type: ignore[arg-type]
        vocab_size=facts.vocab_size,
        max_num_queued_reqs=config.max_num_queued_reqs,
        max_num_queued_tokens=config.max_num_queued_tokens,
        max_tokens_per_mm_item=facts.max_tokens_per_mm_item,
        disable_chunked_mm_input=config.disable_chunked_mm_input,
        async_scheduling=config.async_scheduling,
    )
    cache = CacheConfig(
        num_blocks=facts.num_kv_blocks,
        block_size=config.block_size,
        enable_prefix_caching=config.enable_prefix_caching,
        sliding_window=facts.sliding_window,
    )
    return EngineCore(scheduler, cache, executor, can_recover=config.max_recovery_seconds > 0)


async def serve(config: CoreConfig) -> int:
    """Bring the workers up first (as vLLM's engine does before serving), then build every piece
    complete and open the port."""
    loop = asyncio.get_running_loop()
    to_workers = ChannelSecurity(config.tls, WORKER_ROLE, config.internal_secret)
    pool = WorkerPool(config.worker_addrs, to_workers)
    try:
        facts = await pool.bring_up_with_retries(config, config.model, served_model_name(config))
    except WorkerBringUpError as err:
        report_fatal("core", str(err))
        await pool.close()
        return 1
    info = engine_info(config, facts)
    log_kv_cache(config, facts, info)
    if config.async_scheduling:  # vLLM's wording
        logger.info("Asynchronous scheduling is enabled (--no-async-scheduling: lockstep)")
    host = ServiceHost(
        name="core",
        host=config.host,
        port=config.port,
        service_names=[CORE.grpc_service],
        metrics_port=config.metrics_port,
        grace_seconds=config.shutdown_timeout + 5.0,
        # Only frontends may call the core (health: any peer of the same CA).
        listener=internal_listener(
            tls=config.tls,
            allowed_roles={CORE.grpc_service: frozenset({FRONTEND_ROLE})},
            enable_reflection=config.enable_reflection,
            health_port=config.health_port,
            secret=config.internal_secret,
        ),
    )
    metrics = CoreMetrics(
        host.registry, info.served_model_name, config.engine_id, cache_config_labels(config, facts)
    )

    def on_engine_failed(message: str) -> None:  # loop thread, failure outputs already sent
        loop.call_soon_threadsafe(
            lambda: loop.create_task(host.fail(f"engine failed: {message}; exiting"))
        )

    def on_suspended(fault: Fault) -> None:  # loop thread: the ranks are lost, requests kept
        loop.call_soon_threadsafe(recovery.start, fault)

    def open_executor(first_step_seconds: float = config.execute_timeout) -> GrpcExecutor:
        """Execute streams to every rank under the pool's epoch, with a fresh step budget (new
        ranks get a first-step allowance again: after a recovery, at most what is left of
        --max-recovery-seconds)."""
        first_step_seconds = min(config.execute_timeout, first_step_seconds)
        executor = GrpcExecutor(
            config.worker_addrs,
            config.world_size - config.tensor_parallel_size,
            StepBudget(config.step_timeout_floor, config.step_timeout_multiple, first_step_seconds),
            lambda message, cause: proc.executor_failed(executor, message, cause),
            metrics.observe_worker_step,
            to_workers,
            pool.owner_epoch,
        )
        executor.open()
        return executor

    async def bring_up_again(deadline: float) -> ModelFacts:
        pool.next_epoch()
        return await pool.bring_up_with_retries(config, config.model, info.served_model_name,
                                                deadline)  # fmt: skip

    executor = open_executor()
    streams = ClientStreams(loop)
    proc = EngineCoreProc(
        build_engine(config, facts, executor),
        streams.deliver,
        on_stats=metrics.observe_stats,
        on_failed=on_engine_failed,
        on_suspended=on_suspended,
    )
    recovery = RankRecovery(
        proc=proc,
        executor=executor,
        bring_up=bring_up_again,
        open_executor=open_executor,
        set_ready=host.set_ready,
        metrics=metrics,
        facts=facts,
        max_recovery_seconds=config.max_recovery_seconds,
    )
    servicer = EngineCoreServicer(proc, streams, info, metrics)
    core_grpc.add_EngineCoreServiceServicer_to_server(servicer, host.server)
    gc.collect()
    gc.freeze()  # the block pool's objects are long-lived: keep them out of GC passes
    proc.start()
    await host.start()
    await host.set_ready(True)
    stats_task = None
    if config.log_stats_interval > 0:
        stats_logger = StatsLogger(config.engine_id, facts.device_type, time.monotonic())
        stats_task = asyncio.create_task(
            log_stats_every(config.log_stats_interval, stats_logger, lambda: proc.latest_stats)
        )

    async def drain() -> None:
        await drain_engine(proc, config.shutdown_timeout)
        await servicer.close_streams()

    code = await host.run_until_stopped(on_shutdown=drain)
    await recovery.close()
    if stats_task is not None:
        stats_task.cancel()
    await asyncio.to_thread(proc.stop, 10.0)
    await pool.close()
    return code


async def drain_engine(proc: EngineCoreProc, timeout: float) -> None:
    """Refuse new requests, let the running ones finish for up to `timeout` seconds, then end
    the rest with an error (vLLM's --shutdown-timeout)."""
    proc.drain()
    deadline = time.monotonic() + timeout
    while not proc.is_idle and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if not proc.is_idle:
        logger.warning("shutdown: %.0f s passed; aborting the requests still running", timeout)
        proc.abort_all()
        await asyncio.sleep(0.2)  # let the aborts reach their streams


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    configure_logging(config.log_level, "core", config.log_format)
    return asyncio.run(serve(config))

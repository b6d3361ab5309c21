"""core_svc entry point: parse flags once, bring the workers up, run the busy loop, serve."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Sequence

from core_svc.config import CoreConfig, parse_config
from core_svc.engine_core import EngineCore
from core_svc.engine_loop import EngineCoreProc
from core_svc.grpc_executor import GrpcExecutor
from core_svc.metrics import CoreMetrics
from core_svc.scheduler_config import CacheConfig, SchedulerConfig
from core_svc.server import EngineCoreServicer
from core_svc.worker_pool import ModelFacts, WorkerBringUpError, WorkerPool
from splitserve_contracts.core.v1 import core_service_pb2 as core_pb2
from splitserve_contracts.core.v1 import core_service_pb2_grpc as core_grpc
from splitserve_runtime.log_config import configure_logging
from splitserve_runtime.model_source import served_model_name as default_served_name
from splitserve_runtime.service_host import ServiceHost

logger = logging.getLogger(__name__)
SERVICE_NAME = "splitserve.core.v1.EngineCoreService"
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
        "KV cache: %d blocks x %d tokens = %d tokens, %.2f GiB per rank",
        facts.num_kv_blocks,
        config.block_size,
        tokens,
        facts.kv_cache_bytes_per_rank / GIB,
    )
    logger.info(
        "maximum concurrency for %d-token requests: %.2fx",
        facts.max_model_len,
        info.max_concurrency,
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


def build_engine(config: CoreConfig, facts: ModelFacts, executor: GrpcExecutor) -> EngineCore:
    scheduler = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=facts.max_model_len,
        policy=config.scheduling_policy,  # type: ignore[arg-type]
    )
    cache = CacheConfig(
        num_blocks=facts.num_kv_blocks,
        block_size=config.block_size,
        enable_prefix_caching=config.enable_prefix_caching,
    )
    return EngineCore(scheduler, cache, executor)


async def serve(config: CoreConfig) -> int:
    loop = asyncio.get_running_loop()
    host = ServiceHost(
        name="core",
        host=config.host,
        port=config.port,
        service_names=[SERVICE_NAME],
        metrics_port=config.metrics_port,
    )
    servicer = EngineCoreServicer(loop)
    core_grpc.add_EngineCoreServiceServicer_to_server(servicer, host.server)
    await host.start()
    pool = WorkerPool(config.worker_addrs)
    try:
        await pool.wait_until_reachable(config.worker_connect_timeout)
        facts = await pool.bring_up(config, config.model, served_model_name(config))
    except WorkerBringUpError as err:
        await host.fail(str(err))
        await host.shutdown()
        await pool.close()
        return 1
    info = engine_info(config, facts)
    log_kv_cache(config, facts, info)
    metrics = CoreMetrics(
        host.registry, info.served_model_name, config.engine_id, cache_config_labels(config, facts)
    )

    def on_failure(message: str) -> None:  # any thread
        loop.call_soon_threadsafe(
            lambda: loop.create_task(host.set_unhealthy(f"engine failed: {message}"))
        )

    output_rank = config.world_size - config.tensor_parallel_size
    executor = GrpcExecutor(
        config.worker_addrs,
        output_rank,
        config.execute_timeout,
        on_failure,
        metrics.observe_worker_step,
    )
    executor.open()
    servicer.set_metrics(metrics)
    proc = EngineCoreProc(
        build_engine(config, facts, executor), servicer.output_sink, on_stats=metrics.observe_stats
    )
    gc.collect()
    gc.freeze()  # the block pool's objects are long-lived: keep them out of GC passes
    proc.start()
    servicer.attach(proc, info)
    await host.set_ready(True)
    code = await host.run_until_stopped(on_shutdown=servicer.close_streams)
    await asyncio.to_thread(proc.stop, 10.0)
    await pool.close()
    return code


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    configure_logging(config.log_level, "core")
    return asyncio.run(serve(config))

"""WorkerPool: the core's unary conversation with the worker ranks at start-up.

Order (vLLM's `_initialize_kv_caches` over gRPC): wait for every rank to answer Describe, load the
model on all ranks at once (they rendezvous in torch.distributed), ask each rank how many KV
blocks fit, and initialise every rank with the smallest answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace

import grpc

from core_svc.config import CoreConfig
from core_svc.lora import LoraError, LoraErrorKind
from splitserve_contracts import engine_options_convert, output_convert
from splitserve_contracts.output_types import PoolerConfig
from splitserve_contracts.worker.v1 import worker_service_pb2 as worker_pb2
from splitserve_contracts.worker.v1 import worker_service_pb2_grpc as worker_grpc
from splitserve_runtime.channels import ChannelSecurity, open_aio_channel
from splitserve_runtime.grpc_client_metrics import GrpcClientMetrics
from splitserve_runtime.services import OWNER_EPOCH_METADATA_KEY
from splitserve_runtime.tls import WORKER_ROLE

logger = logging.getLogger(__name__)
RETRY_DELAY_SECONDS = 2.0
GIB = 1024**3


class WorkerBringUpError(RuntimeError):
    """A worker rank could not be reached or refused a start-up call. `is_retryable` is False
    when retrying cannot help (the ranks refused what they were asked: a bad model, flags)."""

    def __init__(self, message: str, is_retryable: bool = True) -> None:
        super().__init__(message)
        self.is_retryable = is_retryable


_REFUSALS = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNIMPLEMENTED,
)


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the ranks agreed on after loading."""

    architecture: str
    vocab_size: int
    max_model_len: int
    dtype: str
    attention_backend: str
    num_kv_blocks: int
    kv_cache_bytes_per_rank: int
    sliding_window: int = 0
    num_state_slots: int = 0
    """State slots on every rank (a model with state layers), the null slot included."""
    device_type: str = ""
    """Rank 0's device ("cpu", "cuda"), from Describe."""
    max_tokens_per_mm_item: int = 0
    """Most placeholder tokens of one image; 0 for a text-only model."""
    pooler_config: PoolerConfig | None = None
    """How the model pools when the ranks serve it as a pooling model; None: generative."""

    def serves_prefix_caching(self, requested: bool) -> bool:
        """Whether the engine caches prefixes when `requested` (--enable-prefix-caching): not
        for an encoder-only model (its blocks hold no KV) nor a model with state layers (its
        state is one per request, after its last token, which no cached block restores)."""
        is_encoder_only = self.pooler_config is not None and self.pooler_config.is_encoder_only
        return requested and not is_encoder_only and not self.num_state_slots


class WorkerPool:
    """One channel per rank, in rank order.

    `owner_epoch` (default: now, in nanoseconds, so a restarted core presents a larger one)
    goes with LoadModel and, as metadata, with every later call: the ranks serve only the core
    that loaded them (worker_svc/ownership.py)."""

    def __init__(
        self,
        addrs: list[str],
        security: ChannelSecurity | None = None,
        owner_epoch: int | None = None,
        grpc_metrics: GrpcClientMetrics | None = None,
    ) -> None:
        self.addrs = addrs
        self.security = security or ChannelSecurity(None, WORKER_ROLE)
        self.owner_epoch = time.time_ns() if owner_epoch is None else owner_epoch
        self.grpc_metrics = grpc_metrics
        """Counts the calls to the ranks (also the executors' step streams)."""
        self.channels = [open_aio_channel(a, self.security, metrics=grpc_metrics) for a in addrs]
        self.stubs = [worker_grpc.WorkerServiceStub(c) for c in self.channels]

    def next_epoch(self) -> int:
        """Move to a larger epoch (a new bring-up of ranks this core may already own: ranks
        it loaded take LoadModel only with a larger one)."""
        self.owner_epoch = max(self.owner_epoch + 1, time.time_ns())
        return self.owner_epoch

    @property
    def owner_metadata(self) -> tuple[tuple[str, str], ...]:
        """The epoch (and the internal secret) as gRPC metadata (a retried bring-up may move to
        a larger epoch)."""
        return self.security.call_metadata((OWNER_EPOCH_METADATA_KEY, str(self.owner_epoch)))

    async def _call_all(
        self, name: str, requests: Sequence[object], timeout: float
    ) -> list[object]:
        """Call every rank at once. The first rank that fails cancels the calls still running
        (e.g. LoadModels waiting in the rendezvous for the rank that failed)."""
        calls = [
            getattr(stub, name)(req, timeout=timeout, metadata=self.owner_metadata)
            for stub, req in zip(self.stubs, requests, strict=True)
        ]
        tasks = [asyncio.ensure_future(call) for call in calls]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for call in calls:
                call.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for rank, result in enumerate(results):
            if isinstance(result, grpc.RpcError) and result.code() != grpc.StatusCode.CANCELLED:
                raise WorkerBringUpError(
                    f"worker rank {rank} ({self.addrs[rank]}) failed {name}: "
                    f"{result.code().name}: {result.details()}",
                    is_retryable=result.code() not in _REFUSALS,
                )
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results

    async def wait_until_reachable(self, timeout: float) -> list[worker_pb2.DescribeResponse]:
        """Describe every rank, retrying while they start."""
        deadline = time.monotonic() + timeout
        replies: list[worker_pb2.DescribeResponse] = []
        for rank, stub in enumerate(self.stubs):
            while True:
                try:
                    request = worker_pb2.DescribeRequest()
                    metadata = self.security.call_metadata()
                    replies.append(await stub.Describe(request, timeout=5.0, metadata=metadata))
                    break
                except grpc.RpcError as err:
                    if time.monotonic() > deadline:
                        raise WorkerBringUpError(
                            f"worker rank {rank} at {self.addrs[rank]} unreachable after "
                            f"{timeout:.0f} s ({err.code().name})"
                        ) from err
                    await asyncio.sleep(0.2)
        for rank, reply in enumerate(replies):
            logger.info(
                "worker rank %d: %s %s on %s (pid %d)",
                rank,
                reply.device_type,
                reply.device_name,
                reply.hostname,
                reply.pid,
            )
        return replies

    async def bring_up_with_retries(
        self,
        config: CoreConfig,
        served_model_name: str,
        deadline: float | None = None,
    ) -> ModelFacts:
        """Bring the ranks up, starting over while attempts fail for reasons that may pass (a
        rank restarting, a wedged rank that exits to restart clean), until `deadline`
        (time.monotonic(); default --worker-connect-timeout from now); a refusal (bad model,
        bad flags) fails at once. Every attempt after the first takes a larger epoch."""
        if deadline is None:
            deadline = time.monotonic() + config.worker_connect_timeout
        attempt = 1
        while True:
            if attempt > 1:
                self.next_epoch()
            try:
                ranks = await self.wait_until_reachable(max(1.0, deadline - time.monotonic()))
                facts = await self.bring_up(config, served_model_name)
                return replace(facts, device_type=ranks[0].device_type)
            except WorkerBringUpError as err:
                if not err.is_retryable or time.monotonic() + RETRY_DELAY_SECONDS > deadline:
                    raise
                logger.warning("bring-up attempt %d failed (%s); retrying", attempt, err)
            attempt += 1
            await asyncio.sleep(RETRY_DELAY_SECONDS)

    async def bring_up(self, config: CoreConfig, served_model_name: str) -> ModelFacts:
        """LoadModel, GetKvCapacity and InitializeKvCache on every rank."""
        world = config.world_size
        rendezvous_id = uuid.uuid4().hex
        options = engine_options_convert.to_proto(config.options)
        loads = [
            worker_pb2.LoadModelRequest(
                options=options,
                rank=rank,
                served_model_name=served_model_name,
                engine_id=config.engine_id,
                rendezvous_id=rendezvous_id,
                owner_epoch=self.owner_epoch,
            )
            for rank in range(world)
        ]
        loaded = await self._call_all("LoadModel", loads, config.worker_connect_timeout)
        first = loaded[0]
        assert isinstance(first, worker_pb2.LoadModelResponse)
        max_model_len = min(r.max_model_len for r in loaded)  # type: ignore[attr-defined]
        capacity_req = worker_pb2.GetKvCapacityRequest(
            gpu_memory_utilization=config.options.cache.gpu_memory_utilization,
            kv_cache_memory_bytes=config.options.cache.kv_cache_memory_bytes,
        )
        capacities = await self._call_all("GetKvCapacity", [capacity_req] * world, 600.0)
        num_blocks = min(c.num_blocks for c in capacities)  # type: ignore[attr-defined]
        _check_fits(num_blocks, config.options.cache.block_size, max_model_len)
        num_state_slots = min(c.num_state_slots for c in capacities)  # type: ignore[attr-defined]
        init = worker_pb2.InitializeKvCacheRequest(
            num_blocks=num_blocks, num_state_slots=num_state_slots
        )
        inited = await self._call_all("InitializeKvCache", [init] * world, 600.0)
        kv_bytes = max(r.kv_cache_bytes for r in inited)  # type: ignore[attr-defined]
        return ModelFacts(
            first.architecture,
            first.vocab_size,
            max_model_len,
            first.dtype,
            first.attention_backend,
            num_blocks,
            kv_bytes,
            sliding_window=min(r.sliding_window for r in loaded),  # type: ignore[attr-defined]
            num_state_slots=num_state_slots,
            max_tokens_per_mm_item=first.max_tokens_per_mm_item,
            pooler_config=output_convert.pooler_config_from_proto(first.pooler_config)
            if first.HasField("pooler_config")
            else None,
        )

    async def load_lora_adapter(
        self, lora_id: int, lora_path: str, timeout: float
    ) -> worker_pb2.LoadLoraAdapterResponse:
        """Every rank reads the adapter; LoraError (INVALID: the first refusing rank's reason;
        UNAVAILABLE: a rank could not be asked) when one does not."""
        request = worker_pb2.LoadLoraAdapterRequest(lora_id=lora_id, lora_path=lora_path)
        calls = [
            stub.LoadLoraAdapter(request, timeout=timeout, metadata=self.owner_metadata)
            for stub in self.stubs
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for rank, result in enumerate(results):
            if isinstance(result, grpc.RpcError):
                kind = _LORA_REFUSALS.get(result.code())
                if kind is not None:
                    raise LoraError(kind, result.details() or "refused")
                raise LoraError(
                    LoraErrorKind.UNAVAILABLE,
                    f"worker rank {rank} could not load the adapter ({result.code().name}: "
                    f"{result.details()}); retry later",
                )
            if isinstance(result, BaseException):
                raise result
        first = results[0]
        assert isinstance(first, worker_pb2.LoadLoraAdapterResponse)
        return first

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()


_LORA_REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT: LoraErrorKind.INVALID,
    grpc.StatusCode.NOT_FOUND: LoraErrorKind.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION: LoraErrorKind.OFF,
}
"""A rank's refusal of an adapter (its files, or LoRA off), not a passing failure."""


def _check_fits(num_blocks: int, block_size: int, max_model_len: int) -> None:
    """One max_model_len request must fit in the blocks a request can hold (all but block 0,
    the null block)."""
    capacity = (num_blocks - 1) * block_size
    if capacity < max_model_len:
        raise WorkerBringUpError(
            f"the KV cache holds {max(capacity, 0)} tokens ({num_blocks} blocks of {block_size}, "
            f"block 0 reserved) but max_model_len is {max_model_len}: lower --max-model-len or "
            "give the KV cache more memory (--kv-cache-memory-bytes / --gpu-memory-utilization)",
            is_retryable=False,
        )


def kv_sizing_reason(config: CoreConfig, facts: ModelFacts) -> str:
    """Why the KV cache has the size it has, for the start-up log (each rank logs its own
    figures: free memory, cgroup limit, VLLM_CPU_KVCACHE_SPACE)."""
    if config.options.cache.kv_cache_memory_bytes > 0:
        return "--kv-cache-memory-bytes"
    block_size, max_num_seqs = (
        config.options.cache.block_size,
        config.options.scheduler.max_num_seqs,
    )
    blocks_per_request = -(-facts.max_model_len // block_size)
    usable = max_num_seqs * blocks_per_request + 1
    if facts.num_kv_blocks >= usable:
        return (
            f"room for max_num_seqs {max_num_seqs} x max_model_len "
            f"{facts.max_model_len} tokens, all the engine can use"
        )
    return "the memory the workers may use (their logs say how much)"

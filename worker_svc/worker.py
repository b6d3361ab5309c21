"""Worker: one tensor-/pipeline-parallel rank, driven through the WorkerService lifecycle.

    describe -> load_model (joins the process group, loads this rank's weight shard)
             -> get_kv_capacity -> initialize_kv_cache -> execute, execute, ... -> shutdown

Calls out of that order raise `WorkerStateError`; bad arguments raise `ValueError`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time

import torch

from splitserve_contracts.output_types import ModelRunnerOutput, PoolerConfig
from splitserve_runtime.engine_option_rules import speculative_config
from splitserve_runtime.log_config import is_text_logging
from splitserve_runtime.model_source import resolve_model
from worker_svc.attention.backend import AttentionBackend
from worker_svc.attention.kv_quant import kv_cache_torch_dtype
from worker_svc.attention.selector import available_backends, select_backend
from worker_svc.device import cpu_name, keep_freed_host_memory, resolve_device
from worker_svc.distributed import ParallelState, Rendezvous, init_parallel_state
from worker_svc.kv_connector.rank_connector import RankKvConnector
from worker_svc.kv_connector.step_hooks import run_step_with_connector
from worker_svc.layers.linear import kv_heads_per_rank
from worker_svc.layers.lora import LoraShape
from worker_svc.lora.adapter import LoraAdapter
from worker_svc.lora.manager import LoraManager
from worker_svc.model_loader.model_build import (
    backend_for_model,
    build_context,
    build_model,
    check_parallel_shape,
    log_kv_cache,
    lora_parts,
    model_class_for,
    pooler_config,
    served_model,
)
from worker_svc.model_loader.model_load import LoadedModel, LoadModelConfig, WorkerDescription
from worker_svc.model_loader.weights import (
    QuantizationOptions,
    open_checkpoint,
    resolve_compute_dtype,
    weight_bytes,
)
from worker_svc.models.interfaces import CausalLM, is_encoder_only, supports_images
from worker_svc.models.model_config import ModelConfig
from worker_svc.runner.cpu_kv_budget import EngineShape, cpu_kv_budget
from worker_svc.runner.kv_cache import KvCapacity, kv_capacity, reserve_state_slots
from worker_svc.runner.model_runner import ModelRunner
from worker_svc.runner.pooler import Pooler
from worker_svc.sample.grammar_bitmask import GrammarSource
from worker_svc.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_PROFILE_TOKENS = 8192


class WorkerStateError(RuntimeError):
    """A call arrived out of the Describe/LoadModel/.../Execute order."""


class Worker:
    """One rank. Thread-compatible, not thread-safe: call it from one thread. `kv` is its KV
    connector seam (the port's slot for the connector's services)."""

    def __init__(
        self, device: str = "auto", rank_hint: int = 0, kv: RankKvConnector | None = None
    ) -> None:
        self.device = resolve_device(device, rank_hint)
        if self.device.type == "cpu":
            keep_freed_host_memory()
        self.parallel = ParallelState()
        self.rendezvous = Rendezvous()
        self.config: LoadModelConfig | None = None
        self.model_config: ModelConfig | None = None
        self.runner: ModelRunner | None = None
        self.pooler_config: PoolerConfig | None = None
        self.weight_bytes = 0
        self.is_kv_cache_ready = False
        self.kv = kv or RankKvConnector()

    @property
    def is_output_rank(self) -> bool:
        return self.parallel.is_output_rank

    def describe(self) -> WorkerDescription:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            name = torch.cuda.get_device_name(self.device)
        else:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
            name = cpu_name()
        return WorkerDescription(
            device_type=self.device.type,
            device_name=name,
            total_memory_bytes=int(total),
            free_memory_bytes=int(free),
            hostname=socket.gethostname(),
            pid=os.getpid(),
            torch_version=torch.__version__,
            attention_backends=available_backends(self.device),
        )

    def load_model(self, config: LoadModelConfig) -> LoadedModel:
        """Join the process group (all ranks concurrently) and load this rank's shard."""
        if self.runner is not None:
            # A restarted engine core is bringing the ranks up again: start from scratch.
            logger.warning("LoadModel on a loaded rank: dropping the old model and process group")
            self.shutdown()
        started = time.perf_counter()
        opts = config.options
        source = resolve_model(opts.model.model, opts.model.revision)
        quantization = opts.model.quantization, opts.model.dequantize_gguf, self.device.type
        checkpoint = open_checkpoint(source, QuantizationOptions(*quantization))
        cls, is_pooling = model_class_for(config, checkpoint)  # refused unknown architectures
        model_config = cls.read_config(checkpoint.hf_config)
        if is_encoder_only(cls) and LoraShape.of(opts.lora) is not None:
            raise ValueError("LoRA adapters are not served on encoder-only (BERT) models")
        dtype = resolve_compute_dtype(
            opts.model.dtype, model_config.checkpoint_dtype or checkpoint.stored_dtype, self.device
        )
        model_config, max_model_len = served_model(model_config, opts.model)
        kv_dtype = kv_cache_torch_dtype(opts.cache.kv_cache_dtype, dtype)
        asked = opts.model.attention_backend
        backend_name = select_backend(asked, self.device, opts.cache.block_size, dtype, kv_dtype)
        backend_name = backend_for_model(backend_name, asked, model_config)
        check_parallel_shape(config, model_config)
        self._join(config)
        try:
            backend, build = build_context(
                backend_name,
                model_config,
                (dtype, kv_dtype),
                max_model_len,
                self.parallel,
                self.device,
            )
            lora = lora_parts(config, self.device, build.cpu_kernels)
            model, wrap = build_model(cls, build, checkpoint, lora)
            # vLLM's bar on one rank only, and never inside JSON logs.
            model.load_weights(wrap(checkpoint.weights(config.rank == 0 and is_text_logging())))
        except BaseException:
            self.parallel.destroy()  # so that a corrected LoadModel can join again
            self.parallel = ParallelState()
            raise
        model.eval()
        log_kv_cache(model, backend)
        self.weight_bytes = weight_bytes(model)
        model.process_weights_after_loading()
        self.pooler_config = (
            pooler_config(source, checkpoint, model_config.hidden_size, is_encoder_only(model))
            if is_pooling
            else None
        )
        self.runner = ModelRunner(
            model,
            backend,
            self.parallel,
            dtype=dtype,
            device=self.device,
            max_model_len=max_model_len,
            max_num_seqs=opts.scheduler.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
            options=opts.model,
            async_scheduling=opts.scheduler.async_scheduling,
            pooler=Pooler(self.pooler_config, getattr(model, "pool_head", None))
            if self.pooler_config is not None
            else None,
            lora=None
            if lora is None
            else LoraManager(model, *lora, opts.lora.max_cpu_loras, dtype),
            speculative_config=speculative_config(opts.speculative),
        )
        self.config, self.model_config = config, model_config
        return self._loaded(model, backend, max_model_len, time.perf_counter() - started)

    def _join(self, config: LoadModelConfig) -> None:
        parallel = config.options.parallel
        self.parallel = init_parallel_state(
            config.rank,
            parallel.tensor_parallel_size,
            parallel.pipeline_parallel_size,
            parallel.distributed_init_method,
            self.device,
            rendezvous=self.rendezvous,
            rendezvous_id=config.rendezvous_id,
        )
        self.parallel.enable_expert_parallel = parallel.enable_expert_parallel

    def _loaded(
        self, model: CausalLM, backend: AttentionBackend, max_model_len: int, seconds: float
    ) -> LoadedModel:
        config = model.config
        start, end = model.layer_range
        return LoadedModel(
            architecture=config.architecture,
            vocab_size=config.vocab_size,
            max_model_len=max_model_len,
            dtype=str(backend.dtype).removeprefix("torch."),
            weight_bytes=self.weight_bytes,
            load_seconds=seconds,
            attention_backend=backend.name,
            num_layers=end - start,
            num_kv_heads=backend.num_kv_heads,
            head_dim=config.head_dim,
            sliding_window=config.kv_sliding_window or 0,
            max_tokens_per_mm_item=model.max_image_tokens if supports_images(model) else 0,
            pooler_config=self.pooler_config,
        )

    def _require_runner(self) -> ModelRunner:
        if self.runner is None:
            raise WorkerStateError("LoadModel must be called first")
        return self.runner

    def get_kv_capacity(
        self, gpu_memory_utilization: float, kv_cache_memory_bytes: int
    ) -> KvCapacity:
        """The blocks (and a model with state layers' state slots: one per sequence the engine
        runs at once, and the null slot, reserved first) that fit the budget."""
        capacity = self._kv_capacity(gpu_memory_utilization, kv_cache_memory_bytes)
        runner = self._require_runner()
        if not runner.state_specs:
            return capacity
        assert self.config is not None
        max_num_seqs = self.config.options.scheduler.max_num_seqs or DEFAULT_MAX_NUM_SEQS
        block_size = self.config.options.cache.block_size
        num_slots, slot_bytes = max_num_seqs + 1, runner.state_bytes_per_slot
        if runner.kv_cache_spec.num_layers == 0:  # a stage of state layers only: no KV here
            return dataclasses.replace(
                capacity, num_state_slots=num_slots, bytes_per_state_slot=slot_bytes
            )
        return reserve_state_slots(
            capacity, runner.kv_cache_spec, block_size, num_slots, slot_bytes
        )

    def _kv_capacity(self, gpu_memory_utilization: float, kv_cache_memory_bytes: int) -> KvCapacity:
        runner = self._require_runner()
        assert self.config is not None
        block_size = self.config.options.cache.block_size
        if runner.kv_cache_spec.num_layers == 0:  # encoder-only: blocks count a step's tokens
            max_num_seqs = self.config.options.scheduler.max_num_seqs or DEFAULT_MAX_NUM_SEQS
            shape = EngineShape(max_num_seqs, runner.max_model_len, block_size)
            return KvCapacity(0, 0, shape.num_blocks_usable())
        if self.device.type == "cpu":
            return self._cpu_kv_capacity(kv_cache_memory_bytes)
        if kv_cache_memory_bytes > 0:
            available = kv_cache_memory_bytes
        else:
            if not 0.0 < gpu_memory_utilization <= 1.0:
                raise ValueError(
                    f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}"
                )
            available = self._cuda_kv_budget(gpu_memory_utilization, block_size)
        return kv_capacity(runner.kv_cache_spec, block_size, available)

    def _cpu_kv_capacity(self, kv_cache_memory_bytes: int) -> KvCapacity:
        """vLLM-CPU's sizing, capped by what the engine can use (worker_svc/cpu_kv_budget)."""
        runner = self._require_runner()
        assert self.config is not None
        block_size = self.config.options.cache.block_size
        spec = runner.kv_cache_spec
        max_num_seqs = self.config.options.scheduler.max_num_seqs or DEFAULT_MAX_NUM_SEQS
        shape = EngineShape(max_num_seqs, runner.max_model_len, block_size)
        budget = cpu_kv_budget(
            kv_cache_memory_bytes, spec.bytes_per_block(block_size), shape, os.environ
        )
        logger.info("KV cache on CPU: %.3f GiB, %s", budget.num_bytes / (1 << 30), budget.reason)
        return kv_capacity(spec, block_size, budget.num_bytes)

    def _cuda_kv_budget(self, utilization: float, block_size: int) -> int:
        """utilization x total memory - (weights + peak activations + memory outside torch).

        A single rank measures the peak of a profile step of max_num_batched_tokens tokens;
        with several ranks (whose collectives would need every rank in the same call) the
        activations are estimated instead."""
        assert self.config is not None and self.model_config is not None
        runner = self._require_runner()
        torch.cuda.synchronize(self.device)
        if self.parallel.world_size == 1:
            torch.cuda.reset_peak_memory_stats(self.device)
            num_tokens = (
                self.config.options.scheduler.max_num_batched_tokens or DEFAULT_PROFILE_TOKENS
            )
            scratch = runner.profile_run(min(num_tokens, runner.max_model_len), block_size)
            torch.cuda.synchronize(self.device)
            used = torch.cuda.max_memory_allocated(self.device) - scratch
            torch.cuda.empty_cache()
        else:
            used = self.weight_bytes + _activation_estimate(
                self.config, self.model_config, self.parallel
            )
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = max(0, (total - free) - torch.cuda.memory_reserved(self.device))
        return int(utilization * total) - used - non_torch

    def initialize_kv_cache(self, num_blocks: int, num_state_slots: int = 0) -> int:
        """Allocate the cache (block 0 is the null block; slot 0 of a state cache the null
        slot); returns its bytes on this rank."""
        runner = self._require_runner()
        if self.is_kv_cache_ready:
            raise WorkerStateError("the KV cache is already initialized")
        assert self.config is not None
        max_num_seqs = self.config.options.scheduler.max_num_seqs or DEFAULT_MAX_NUM_SEQS
        if runner.state_specs and not 2 <= num_state_slots <= max_num_seqs + 1:
            raise ValueError(
                f"num_state_slots must be in 2..{max_num_seqs + 1} for this model's state layers, "
                f"got {num_state_slots}"
            )
        nbytes = runner.initialize_kv_cache(
            num_blocks, self.config.options.cache.block_size, num_state_slots
        )
        runner.warm_up()
        self.kv.start(self.config.options, runner)
        self.is_kv_cache_ready = True
        return nbytes

    def execute(
        self, step: SchedulerOutput, grammar_source: GrammarSource | None = None
    ) -> ModelRunnerOutput | None:
        """Run a step; `grammar_source` gives its deferred bitmask (has_pending_grammar)."""
        runner = self._require_runner()
        if not self.is_kv_cache_ready:
            raise WorkerStateError("InitializeKvCache must be called before Execute")
        if (connector := self.kv.connector) is None:
            return runner.execute(step, grammar_source)
        return run_step_with_connector(
            connector, step, lambda: runner.execute(step, grammar_source)
        )

    def read_lora_adapter(self, lora_id: int, lora_path: str) -> LoraAdapter:
        """Read a LoRA adapter for this rank (ValueError: why it cannot be served); changes
        nothing, so it may run beside a step."""
        return self._require_lora().read(lora_id, lora_path)

    def keep_lora_adapter(self, adapter: LoraAdapter) -> None:
        """Cache a read adapter for the steps that will put it in a slot."""
        self._require_lora().keep(adapter)

    def _require_lora(self) -> LoraManager:
        lora = self._require_runner().lora
        if lora is None:
            raise WorkerStateError(
                "LoRA is off on this rank (the engine runs without --enable-lora)"
            )
        return lora

    def shutdown(self) -> None:
        """Drop the model and cache and leave the process group; a new LoadModel may follow."""
        self.kv.stop()
        self.runner = None
        self.config = self.model_config = None
        self.is_kv_cache_ready = False
        self.parallel.destroy()
        self.parallel = ParallelState()


def _activation_estimate(
    config: LoadModelConfig, model: ModelConfig, parallel: ParallelState
) -> int:
    """Peak activation bytes of a step: a few [tokens, width] buffers plus float32 logits."""
    tokens = config.options.scheduler.max_num_batched_tokens or 8192
    tp = parallel.tp_size
    num_kv_heads = kv_heads_per_rank(model.num_kv_heads, tp)
    width = model.hidden_size * 4 + (model.num_heads // tp + 2 * num_kv_heads) * model.head_dim
    width += 3 * model.intermediate_size // tp
    logits = (
        (config.options.scheduler.max_num_seqs or DEFAULT_MAX_NUM_SEQS) * model.vocab_size * 4 * 3
    )
    return tokens * width * 4 + logits

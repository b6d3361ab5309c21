"""ModelRunner: one engine step on one rank — update state, prepare inputs, forward, sample.

    SchedulerOutput --update_states--> InputBatch rows --prepare_inputs--> StepInputs
        --> attention metadata (once) --> model stage forward (PP: recv / send hidden states)
        --> last stage: logits at logits_indices (+ prompt positions) --> Sampler
        --> ModelRunnerOutput (output rank only)

Every rank runs the same steps in the same order; tensor-parallel ranks of the last stage
sample identically (all-gathered logits, identically seeded generators), so each keeps a
consistent copy of every request's state. Sampled tokens reach the rank's state through the
next step's diff (CachedRequestData.new_token_ids), as on every other rank; under async
scheduling (the core schedules step N+1 before step N's output came back, so it cannot send
them) each sampling rank appends them at once instead, and step N+1 takes them as its inputs.

This module executes the step; what it makes of the step before the forward, beside the
batch's own inputs, is runner_inputs.py (LoRA rows, attention inputs), and what it returns is
runner_output.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from splitserve_contracts.engine_options_types import ModelOptions
from splitserve_contracts.output_types import LogprobsTable, ModelRunnerOutput, StepTimings
from splitserve_contracts.spec_decode import SpeculativeConfig
from worker_svc.attention.backend import AttentionBackend, AttentionInputs
from worker_svc.distributed import ParallelState
from worker_svc.kernels.cpu_kernels import CpuKernels
from worker_svc.layers.state_cache import LayerCache
from worker_svc.lora.manager import LoraManager
from worker_svc.models.interfaces import (
    CausalLM,
    is_encoder_only,
    is_hybrid,
    supports_images,
    uses_mrope,
)
from worker_svc.runner.encoder_runner import EncoderRunner, MmEmbeddings
from worker_svc.runner.input_batch import InputBatch
from worker_svc.runner.kv_cache import KvCacheSpec, PagedKVCache
from worker_svc.runner.pooler import Pooler
from worker_svc.runner.prompt_logprobs import PromptLogprobsCollector
from worker_svc.runner.runner_inputs import apply_lora_slots, attention_inputs, group_by_adapter
from worker_svc.runner.runner_output import Sampled, add_sampled, append_sampled, step_output
from worker_svc.runner.spec_decode import SpecDecoder
from worker_svc.runner.state_cache import StateCache, state_bytes_per_slot
from worker_svc.runner.step_inputs import StepInputs
from worker_svc.runner.warm_up import dummy_step, scratch_state, warm_up_steps
from worker_svc.sample.grammar_bitmask import GrammarSource, apply_grammar_bitmask
from worker_svc.sample.sampler import Sampler
from worker_svc.sample.sampling_metadata import SamplingStates
from worker_svc.scheduler_output import GrammarBitmask, SchedulerOutput

logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs steps for one loaded model shard; `initialize_kv_cache` must come first."""

    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        parallel: ParallelState,
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        max_num_seqs: int,
        options: ModelOptions,
        async_scheduling: bool = False,
        speculative_config: SpeculativeConfig | None = None,
        pooler: Pooler | None = None,
        lora: LoraManager | None = None,
    ) -> None:
        self.model = model
        self.backend = backend
        self.parallel = parallel
        self.dtype = dtype
        self.device = device
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.vocab_size = model.config.vocab_size
        self.sampler = Sampler(device, options)
        self.cpu_kernels = CpuKernels.load() if backend.uses_cpu_kernels else None
        """The CPU kernels the backend runs (loaded once per process), for the grammar masks."""
        self.pooler = pooler
        """A pooling model's pooler (--runner pooling): its requests finish their prompt with
        a pooled vector instead of a sampled token; None for a generative model."""
        self.is_async_scheduling = async_scheduling
        self.spec = (
            None if speculative_config is None else SpecDecoder(speculative_config, max_model_len)
        )
        """Speculative decoding: proposes drafts into the draft slots and verifies them."""
        start, end = model.layer_range
        self.state_specs = list(model.state_specs) if is_hybrid(model) else []
        """Per layer of the stage, its state (None: an attention layer); empty: no state layers."""
        self.state_bytes_per_slot = state_bytes_per_slot(self.state_specs)
        self.state_cache: StateCache | None = None
        num_state_layers = len(self.state_specs) - self.state_specs.count(None)
        self.kv_cache_spec = KvCacheSpec(
            num_layers=0 if is_encoder_only(model) else end - start - num_state_layers,
            num_kv_heads=backend.num_kv_heads,
            head_dim=backend.head_dim,
            dtype=backend.kv_cache_dtype,
            num_halves=backend.kv_cache_shape(1, 1)[0],
        )
        self.kv_cache: PagedKVCache | None = None
        self.batch: InputBatch | None = None
        self.prompt_logprobs = PromptLogprobsCollector()
        self._failed: dict[int, str] = {}
        """Requests the current step refused, reported in its output."""
        self._row_slots = np.zeros(0, np.int64)
        """The LoRA slot of each row of the current step (NO_SLOT: the base model)."""
        self.lora = lora
        """The LoRA adapters and slots (None: LoRA off; requests naming an adapter are
        refused)."""
        self._attention_metadata: Callable[[AttentionInputs], object] = backend.build_metadata
        """The step's attention metadata: the backend's, or an encoder-only model's own (it
        attends without the paged cache, which then has no layers)."""
        if is_encoder_only(model):
            self._attention_metadata = model.attention_metadata
        self.encoder_runner: EncoderRunner | None = None
        """Images of a multimodal model's requests (encoder_runner.py); None for text-only."""
        if supports_images(model):
            self.encoder_runner = EncoderRunner(model, device)

    def initialize_kv_cache(
        self, num_blocks: int, block_size: int, num_state_slots: int = 0
    ) -> int:
        """Allocate the cache (and the state cache of a model with state layers: `num_state_slots`
        slots) and the per-request tables; returns the caches' bytes."""
        if bool(num_state_slots) != bool(self.state_specs):
            raise ValueError(
                f"{num_state_slots} state slots for {len(self.state_specs)} state specs"
            )
        self.kv_cache = PagedKVCache(
            self.backend, self.kv_cache_spec, num_blocks, block_size, self.device
        )
        if self.state_specs:
            self.state_cache = StateCache(self.state_specs, num_state_slots, self.device)
        self.batch = InputBatch(
            max_model_len=self.max_model_len,
            block_size=block_size,
            vocab_size=self.vocab_size,
            num_kv_blocks=num_blocks,
            capacity=max(self.max_num_seqs, 1),
            sampling=SamplingStates(max(self.max_num_seqs, 1), self.vocab_size, self.device),
            is_pooling=self.pooler is not None,
            num_state_slots=num_state_slots,
        )
        state_bytes = 0 if self.state_cache is None else self.state_cache.nbytes
        return self.kv_cache.nbytes + state_bytes

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run a dummy prefill and decode once, so first-use costs (oneDNN primitives, allocator
        growth, the sampler's first call) are paid before serving: through the whole step path
        (worker_svc/runner/warm_up.py), or the forward only, in a scratch cache, for pooling models and
        speculative decoding. Single rank only: collectives would need every rank."""
        assert self.kv_cache is not None and self.batch is not None
        if self.parallel.world_size > 1:
            return
        block_size = self.kv_cache.block_size
        steps = warm_up_steps(
            block_size, self.kv_cache.num_blocks, self.is_async_scheduling, self.state_cache
        )
        if steps and self.pooler is None and self.spec is None:
            for step in steps:
                self.execute(step)
            assert not self.batch.num_reqs, "the warm-up request must leave the batch"
            return
        scratch = PagedKVCache(
            self.backend, self.kv_cache_spec, 2 + 9 // block_size, block_size, self.device
        )
        scratch.zero_blocks(np.arange(scratch.num_blocks))
        state = scratch_state(self)
        dummy_step(self, scratch, state, 0, 8, num_logits=1)
        dummy_step(self, scratch, state, 8, 9, num_logits=1)

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, block_size: int) -> int:
        """Run one dummy step of `num_tokens` tokens (and `max_num_seqs` logits rows) in a
        scratch cache, for peak-memory profiling; returns the scratch cache's bytes."""
        num_blocks = 1 - (-num_tokens // block_size)
        scratch = PagedKVCache(
            self.backend, self.kv_cache_spec, num_blocks, block_size, self.device
        )
        num_logits = min(num_tokens, self.max_num_seqs)
        dummy_step(self, scratch, scratch_state(self), 0, num_tokens, num_logits)
        return scratch.nbytes

    # -- the step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(
        self, step: SchedulerOutput, grammar_source: GrammarSource | None = None
    ) -> ModelRunnerOutput | None:
        """Run one step; returns the output on the output rank, None elsewhere. A step with
        has_pending_grammar takes its token masks from `grammar_source` before sampling."""
        if self.batch is None or self.kv_cache is None:
            raise RuntimeError("initialize_kv_cache must run before execute")
        started = time.perf_counter()
        batch = self.batch
        mm_refused: dict[int, str] = {}
        if self.encoder_runner is not None:
            step, mm_refused = self.encoder_runner.refuse_bad_requests(step)
        apply_lora_slots(self.lora, step)
        step_plan = batch.update_states(step)
        if self.encoder_runner is not None:
            step_plan.failed.update(mm_refused)
            self.encoder_runner.update(step, step_plan.failed)
        step_plan, self._row_slots = group_by_adapter(batch, self.lora, step_plan)
        gone = [*step.finished_req_handles.tolist(), *step_plan.failed]
        self.prompt_logprobs.forget(gone)
        if self.pooler is not None:
            self.pooler.forget(gone)
        if len(step_plan.fresh_block_ids):
            self.kv_cache.zero_blocks(step_plan.fresh_block_ids)
        if self.state_cache is not None:
            self.state_cache.zero_slots(step_plan.fresh_state_slots)
        self._failed = step_plan.failed
        if not len(step_plan.rows):
            return self._output(step, started, None, None, {}, StepTimings())
        if self.spec is not None:
            step_plan = self.spec.propose(batch, step_plan)
        inputs = batch.prepare_inputs(step_plan)
        if self.lora is not None:
            self.lora.set_step_rows(np.repeat(self._row_slots, step_plan.num_scheduled_tokens))
        plan = self.prompt_logprobs.plan(batch, inputs) if self.parallel.is_last_stage else None
        prepared = time.perf_counter()

        mm = None
        if self.encoder_runner is not None and self.parallel.is_first_stage:
            mm = self.encoder_runner.step_embeddings(step, inputs)
        state = None
        if self.state_cache is not None:
            state = self.state_cache, batch.state_slots[inputs.rows]
        hidden = self.forward_step(inputs, self.kv_cache, mm, state)
        batch.finish_step(inputs)
        if hidden is None:  # not the last pipeline stage
            return None
        if self.pooler is not None:
            return self._pool(step, started, prepared, hidden, inputs)
        num_sampling = len(inputs.logits_indices)
        index = inputs.logits_indices
        if plan is not None:
            index = np.concatenate([index, plan.token_index])
        logits = self.model.compute_logits(hidden[self._to_device(index)])
        self._synchronize()
        forwarded = time.perf_counter()

        sampled = None
        if num_sampling:
            grammar = step.grammar_bitmask
            if step.has_pending_grammar and grammar_source is not None:
                grammar = grammar_source()
            sampled = self._sample(inputs, logits[:num_sampling], grammar)
        if plan is not None:
            self.prompt_logprobs.collect(plan, logits[num_sampling:])
        sampled_handles = set(inputs.req_handles[inputs.sampling_reqs].tolist())
        prompt_tables = self.prompt_logprobs.take_finished(plan, sampled_handles)
        timings = StepTimings(
            prepare_inputs_seconds=prepared - started,
            forward_seconds=forwarded - prepared,
            sample_seconds=time.perf_counter() - forwarded,
        )
        return self._output(step, started, inputs, sampled, prompt_tables, timings)

    def _sample(
        self, inputs: StepInputs, logits: torch.Tensor, grammar: GrammarBitmask | None
    ) -> Sampled:
        """Sample every logits row (grammar masks first); a step with drafts verifies them and
        rolls each request's computed tokens back to what it accepted."""
        batch, spec = self.batch, self.spec
        assert batch is not None
        handles = inputs.req_handles[inputs.sampling_reqs]
        if spec is None:
            rows = inputs.rows[inputs.sampling_reqs]
            num_tokens = batch.num_tokens[rows]
        else:
            rows, num_tokens = spec.expand(batch, inputs)
            if inputs.num_drafts is not None:
                handles = np.repeat(handles, inputs.num_drafts + 1)
            spec.save_generators(batch, inputs)
        metadata = batch.sampling.build(
            rows, batch.token_ids, batch.num_prompt_tokens[rows], num_tokens
        )
        if grammar is not None:
            apply_grammar_bitmask(logits, handles, grammar, self.cpu_kernels)
        sampler_output = self.sampler(logits, metadata)
        verified = None
        if spec is not None and inputs.num_drafts is not None:
            tokens = sampler_output.sampled_token_ids.cpu().numpy().astype(np.int64)
            verified = spec.verify(batch, inputs, tokens)
            num_rejected = inputs.num_drafts - (verified.num_sampled - 1)
            batch.num_computed_tokens[inputs.rows[inputs.sampling_reqs]] -= num_rejected
        sampled = Sampled(sampler_output, verified)
        if self.is_async_scheduling:  # the next step takes them as its inputs at once
            append_sampled(batch, inputs, sampled)
        return sampled

    def _pool(
        self,
        step: SchedulerOutput,
        started: float,
        prepared: float,
        hidden: torch.Tensor,
        inputs: StepInputs,
    ) -> ModelRunnerOutput | None:
        """A pooling model's step: pooled vectors of the prompts that completed, no sampling."""
        assert self.pooler is not None
        pooled, failed = self.pooler.pool(hidden, inputs)
        self._failed.update(failed)
        forwarded = time.perf_counter()
        timings = StepTimings(prepared - started, forwarded - prepared, 0.0)
        output = self._output(step, started, None, None, {}, timings)
        if output is not None:
            output.pooler_outputs = pooled
        return output

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _positions(self, inputs: StepInputs) -> np.ndarray:
        """The step's positions: [3, num_tokens] for an M-RoPE model, else [num_tokens]."""
        if self.encoder_runner is not None and uses_mrope(self.model):
            return self.encoder_runner.mrope_positions(inputs)
        return inputs.positions

    def forward_step(
        self,
        inputs: StepInputs,
        kv_cache: PagedKVCache,
        mm: MmEmbeddings | None = None,
        state: tuple[StateCache, np.ndarray] | None = None,
    ) -> torch.Tensor | None:
        """This stage's forward; returns final hidden states on the last stage, else None.
        `mm` (first stage) replaces placeholder tokens' embeddings with image embeddings;
        `state` is a model with state layers' cache and the slot of each request of `inputs`."""
        positions = self._to_device(self._positions(inputs))
        metadata = self._attention_metadata(attention_inputs(inputs, kv_cache))
        ctx = self.model.step_context(positions, metadata)
        caches: Sequence[LayerCache] = kv_cache.layers
        if state is not None:
            ctx = state[0].with_state(ctx, inputs, state[1], self.device)
            caches = state[0].layer_caches(kv_cache.layers)
        parallel = self.parallel
        hidden = residual = None
        input_ids = None
        if parallel.is_first_stage:
            input_ids = self._to_device(inputs.input_ids)
            if mm is not None and self.encoder_runner is not None:
                hidden, input_ids = self.encoder_runner.embed(input_ids, mm), None
        else:
            shape = (inputs.num_tokens, self.model.config.hidden_size)
            hidden, residual = parallel.recv_from_prev_stage(2, shape, self.dtype, self.device)
        hidden, residual = self.model(input_ids, ctx, caches, hidden, residual)
        if parallel.is_last_stage:
            return hidden
        assert residual is not None
        parallel.send_to_next_stage([hidden, residual])
        return None

    # -- output --------------------------------------------------------------------------------

    def _output(
        self,
        step: SchedulerOutput,
        started: float,
        inputs: StepInputs | None,
        sampled: Sampled | None,
        prompt_tables: dict[int, LogprobsTable],
        timings: StepTimings,
    ) -> ModelRunnerOutput | None:
        if not self.parallel.is_output_rank:
            return None
        batch, rank = self.batch, self.parallel.rank
        output = step_output(
            step.step_id, rank, started, timings, prompt_tables, batch, self._failed
        )
        if inputs is not None and sampled is not None:
            add_sampled(output, inputs, sampled, batch)
        return output

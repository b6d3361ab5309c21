"""Scheduler and KV-cache configuration of the engine core: the options records the core's
flags filled (common.v1.EngineOptions: what they mean, and their rules in
splitserve_runtime/engine_option_rules.py) beside the facts the worker ranks reported."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Self

from splitserve_contracts.engine_options_types import CacheOptions, LoRAOptions, SchedulerOptions
from splitserve_contracts.spec_decode import SpeculativeConfig
from splitserve_runtime.engine_option_rules import engine_options

DEFAULT_MAX_NUM_SEQS = SchedulerOptions().max_num_seqs
"""Most requests running at once, unless configured (the contract's default)."""
DEFAULT_MAX_NUM_BATCHED_TOKENS_PER_RANK = SchedulerOptions().max_num_batched_tokens
"""Token budget of one step per worker rank, unless configured: vLLM's `vllm serve` default on
CPU (2048 x tensor_parallel_size x pipeline_parallel_size)."""


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    """How many requests and tokens one engine step may carry: the scheduler's and LoRA's
    options, and what the model allows."""

    scheduler: SchedulerOptions = field(default_factory=SchedulerOptions)
    """The scheduler's options (budgets, policy, queue limits, async scheduling)."""
    lora: LoRAOptions = field(default_factory=LoRAOptions)
    """The LoRA options (the adapter slots among the running requests)."""
    max_model_len: int = 4096
    """Longest sequence (prompt + output) in tokens."""
    vocab_size: int = 1 << 32
    """Token ids must be below it, in requests and in what the workers sample (the default
    accepts every uint32)."""
    max_tokens_per_mm_item: int = 0
    """Most placeholder tokens one image takes (the workers' report); 0: a text-only model."""
    is_pooling: bool = False
    """The ranks serve a pooling model (--runner pooling): the engine takes pooling requests
    only (each computes its prompt and finishes with its pooled vector), and no others."""
    is_encoder_only: bool = False
    """The pooling model is encoder-only (BERT-style, bidirectional attention): a prompt is
    computed whole, in one step (vLLM disables chunked prefill for it), so a prompt longer
    than max_num_batched_tokens is refused and one that does not fit this step's budget waits
    for the next."""
    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding (vLLM's --speculative-config): a decoding request gets up to
    num_speculative_tokens draft slots per step while few enough requests run; the ranks
    propose and verify the drafts."""

    @classmethod
    def of(cls, **values: Any) -> Self:
        """A config from flat names, options among them (`SchedulerConfig.of(max_num_seqs=8,
        max_model_len=64)`: tests, benchmarks); options not named keep the contract's
        defaults."""
        names = {n: values.pop(n) for n in list(values) if n not in cls.__dataclass_fields__}
        options = engine_options(names)
        return cls(scheduler=options.scheduler, lora=options.lora, **values)

    @property
    def encoder_compute_budget(self) -> int:
        """Encoder tokens one step may compute, and the size of the workers' encoder cache in
        encoder tokens (vLLM's compute_encoder_budget: at least one whole item)."""
        return max(self.scheduler.max_num_batched_tokens, self.max_tokens_per_mm_item)

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")
        item, chunk = self.max_tokens_per_mm_item, self.scheduler.long_prefill_token_threshold
        if self.scheduler.disable_chunked_mm_input and (
            item > self.scheduler.max_num_batched_tokens or 0 < chunk < item
        ):
            raise ValueError(
                "scheduler.disable_chunked_mm_input needs a step to fit a whole image "
                f"({item} tokens): raise max_num_batched_tokens / long_prefill_token_threshold"
            )


@dataclass(slots=True, frozen=True)
class CacheConfig:
    """Shape of the paged KV cache the workers allocated.

    Block 0 is reserved as the null block (never handed to a request), so a request can
    use at most `num_blocks - 1` blocks; workers may point padding slots at it.
    """

    num_blocks: int
    """KV blocks on every worker rank, the null block included."""
    cache: CacheOptions = field(default_factory=CacheOptions)
    """The cache's options: block_size (tokens per block), enable_prefix_caching (share full
    blocks between requests with the same prefix)."""
    sliding_window: int = 0
    """When > 0, every layer attends only to this many latest tokens: blocks that fall out of
    the window are freed while the request runs (0: the model needs all of its KV)."""
    num_state_slots: int = 0
    """State slots on every rank, the null slot included: the state group of a model with state
    layers (Mamba2, gated DeltaNet), one slot per request it runs; 0: no state layers."""

    @classmethod
    def of(
        cls, num_blocks: int, sliding_window: int = 0, num_state_slots: int = 0, **options: Any
    ) -> Self:
        """A cache config from flat option names (`CacheConfig.of(64, block_size=4)`: tests,
        benchmarks)."""
        return cls(num_blocks, replace(CacheOptions(), **options), sliding_window, num_state_slots)

    def __post_init__(self) -> None:
        if self.num_state_slots == 1 or self.num_state_slots < 0:
            raise ValueError(
                f"num_state_slots must be 0 or >= 2 (slot 0 is reserved), got {self.num_state_slots}"
            )
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0, got {self.sliding_window}")
        if self.num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is reserved), got {self.num_blocks}"
            )

"""Scheduler and KV-cache configuration of the engine core."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from splitserve_contracts.spec_decode import SpeculativeConfig

SchedulingPolicy = Literal["fcfs", "priority"]

DEFAULT_MAX_NUM_SEQS = 256
"""Most requests running at once, unless configured."""
DEFAULT_MAX_NUM_BATCHED_TOKENS_PER_RANK = 2048
"""Token budget of one step per worker rank, unless configured: vLLM's `vllm serve` default on
CPU (2048 x tensor_parallel_size x pipeline_parallel_size)."""
DEFAULT_PREFILL_TOKEN_BUDGET = 0
"""Prompt tokens one step computes while some request decodes, unless configured (0: no cap
beyond max_num_batched_tokens)."""
DEFAULT_ADAPTIVE_PREFILL_CHUNK = 192
"""Prompt tokens one step computes under a light load while requests decode, unless
configured (0: the adaptive chunk is off); see core_svc/sched/prefill_policy.py."""


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    """How many requests and tokens one engine step may carry."""

    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    """Most requests running at once."""
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS_PER_RANK
    """Token budget of one step (prefill chunks and decodes together)."""
    max_model_len: int = 4096
    """Longest sequence (prompt + output) in tokens."""
    policy: SchedulingPolicy = "fcfs"
    """"fcfs": arrival order; "priority": lower `priority` first, ties by arrival."""
    long_prefill_token_threshold: int = 0
    """When > 0, most prompt tokens one request may compute in one step (vLLM's flag)."""
    prefill_token_budget: int = DEFAULT_PREFILL_TOKEN_BUDGET
    """When > 0 and some running request is decoding, the most prompt tokens (running prefill
    chunks and new admissions together) one step computes, so a burst of prompts cannot
    stretch the decoders' inter-token gap; decodes keep their own tokens. 0: prefills share
    max_num_batched_tokens with decodes freely (vLLM's behaviour)."""
    adaptive_prefill_chunk: int = DEFAULT_ADAPTIVE_PREFILL_CHUNK
    """When > 0, the adaptive chunk (core_svc/sched/prefill_policy.py): while at least 3 requests
    decode and at most 3 have prompt tokens to compute, a step computes at most N prompt
    tokens; and no step is built ahead of one that computes prompt tokens. 0: the static
    limits only (vLLM's behaviour)."""
    vocab_size: int = 1 << 32
    """Token ids must be below it, in requests and in what the workers sample (the default
    accepts every uint32)."""
    max_num_queued_reqs: int = 0
    """When > 0, most requests waiting to be scheduled; more are refused as OVERLOADED."""
    max_num_queued_tokens: int = 0
    """When > 0, most prompt tokens waiting to be scheduled; more are refused as OVERLOADED."""
    max_tokens_per_mm_item: int = 0
    """Most placeholder tokens one image takes (the workers' report); 0: a text-only model."""
    disable_chunked_mm_input: bool = False
    """Never split an image's placeholders over steps (vLLM's --disable-chunked-mm-input)."""
    async_scheduling: bool = False
    """Schedule step N+1 while the workers run step N (vLLM's --async-scheduling): decodes are
    scheduled with output placeholders and the workers feed their own sampled tokens."""
    is_pooling: bool = False
    """The ranks serve a pooling model (--runner pooling): the engine takes pooling requests
    only (each computes its prompt and finishes with its pooled vector), and no others."""
    is_encoder_only: bool = False
    """The pooling model is encoder-only (BERT-style, bidirectional attention): a prompt is
    computed whole, in one step (vLLM disables chunked prefill for it), so a prompt longer
    than max_num_batched_tokens is refused and one that does not fit this step's budget waits
    for the next."""
    max_loras: int = 0
    """Most distinct LoRA adapters among the running requests (vLLM's --max-loras); 0: LoRA is
    off and requests naming an adapter are refused."""
    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding (vLLM's --speculative-config): a decoding request gets up to
    num_speculative_tokens draft slots per step while few enough requests run; the ranks
    propose and verify the drafts."""

    @property
    def encoder_compute_budget(self) -> int:
        """Encoder tokens one step may compute, and the size of the workers' encoder cache in
        encoder tokens (vLLM's compute_encoder_budget: at least one whole item)."""
        return max(self.max_num_batched_tokens, self.max_tokens_per_mm_item)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if self.prefill_token_budget < 0:
            raise ValueError("prefill_token_budget must be >= 0")
        if self.adaptive_prefill_chunk < 0:
            raise ValueError("adaptive_prefill_chunk must be >= 0")
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")
        item, chunk = self.max_tokens_per_mm_item, self.long_prefill_token_threshold
        if self.disable_chunked_mm_input and (
            item > self.max_num_batched_tokens or 0 < chunk < item
        ):
            raise ValueError(
                f"disable_chunked_mm_input needs a step to fit a whole image ({item} tokens): "
                "raise max_num_batched_tokens / long_prefill_token_threshold"
            )


@dataclass(slots=True, frozen=True)
class CacheConfig:
    """Shape of the paged KV cache the workers allocated.

    Block 0 is reserved as the null block (never handed to a request), so a request can
    use at most `num_blocks - 1` blocks; workers may point padding slots at it.
    """

    num_blocks: int
    """KV blocks on every worker rank, the null block included."""
    block_size: int = 16
    """Tokens per block."""
    enable_prefix_caching: bool = True
    """Share full blocks between requests with the same prefix."""
    sliding_window: int = 0
    """When > 0, every layer attends only to this many latest tokens: blocks that fall out of
    the window are freed while the request runs (0: the model needs all of its KV)."""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0, got {self.sliding_window}")
        if self.num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is reserved), got {self.num_blocks}"
            )

"""The attention backend interface (the choice between backends: selector.py).

A backend owns the layout of one layer's paged KV cache and does two things per layer: write
the step's keys and values into the cache at `slot_mapping`, then attend each query token
over its request's cached context (read through the request's block table), causally.
Per-step index work happens once in `build_metadata`; `forward` runs once per layer.

Layers may differ in `AttentionOptions` (a sliding window, soft-capped scores, their own softmax
scale): `with_options` gives a layer its own view of the shared backend, and the step's metadata
serves every view.
"""

from __future__ import annotations

import copy
import importlib.util
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import numpy.typing as npt
import torch

from worker_svc.attention.kv_quant import KvScales, as_bytes, dequantize, is_fp8, quantize

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class AttentionInputs:
    """What every backend needs to know about a step, on the host.

    Requests occupy consecutive token ranges `query_start_loc[i]:query_start_loc[i + 1]`; the
    query of request i is its last `query_lens[i]` tokens of `seq_lens[i]`. Rows of
    `block_tables` are padded with `null_block_id`, a zeroed block no request owns.
    """

    query_start_loc: IntArray
    seq_lens: IntArray
    block_tables: IntArray
    slot_mapping: IntArray
    block_size: int
    null_block_id: int

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def query_lens(self) -> IntArray:
        return np.diff(self.query_start_loc)

    @property
    def max_query_len(self) -> int:
        return int(self.query_lens.max(initial=0))

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max(initial=0))


@dataclass(frozen=True, slots=True)
class AttentionOptions:
    """How one layer attends, beyond causality.

    `sliding_window` w: query position p sees keys at p - w < k <= p (w keys, itself included;
    transformers' and Mistral's convention). `logits_soft_cap` c: scores become
    c * tanh(scores / c) before the mask and softmax (Gemma 2). `scale` replaces head_dim ** -0.5
    (Gemma's query_pre_attn_scalar ** -0.5). `has_sinks`: a learned logit per query head joins
    every softmax's denominator and attends to nothing (gpt-oss's attention sinks; the layer's
    values come with `with_sinks`)."""

    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    scale: float | None = None
    has_sinks: bool = False

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.logits_soft_cap is not None and self.logits_soft_cap <= 0:
            raise ValueError(f"logits_soft_cap must be > 0, got {self.logits_soft_cap}")


class AttentionBackend(ABC):
    """One paged-attention implementation, built for one model shard's head layout."""

    name: ClassVar[str]
    uses_cpu_kernels: ClassVar[bool] = False
    """Whether the backend (and the layers beside it) run the CPU kernels (worker_svc/kernels)
    where they load: such a backend is built inside `using_cpu_kernels`."""
    supports_fp8_kv_cache: ClassVar[bool] = False
    """Whether the backend stores an fp8 KV cache (--kv-cache-dtype fp8/fp8_e5m2)."""
    supports_sinks: ClassVar[bool] = False
    """Whether the backend attends with attention sinks (`AttentionOptions.has_sinks`)."""
    options: AttentionOptions = AttentionOptions()
    sinks: torch.Tensor | None = None
    """This layer's sink logits [num_heads] (this rank's heads), when it has them."""
    kv_scales: KvScales = KvScales()
    """This layer's per-tensor KV scales (fp8 caches only; 1.0 unless the checkpoint has them)."""
    caches_latent_values: ClassVar[bool] = False
    """Whether the cache holds keys only, each value being the first `value_dim` of its key
    (multi-head latent attention: the latent and its rope part are the key, the latent alone
    the value)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        kv_cache_dtype: torch.dtype | None = None,
        value_dim: int | None = None,
    ) -> None:
        """`kv_cache_dtype`: how the cache stores keys and values (None: `dtype`; or fp8);
        `value_dim`: the values' width where it is not `head_dim` (latent values only)."""
        if value_dim not in (None, head_dim) and not self.caches_latent_values:
            raise ValueError(f"the {self.name} attention backend has no latent (MLA) cache")
        self.value_dim = head_dim if value_dim is None else value_dim
        kv_cache_dtype = dtype if kv_cache_dtype is None else kv_cache_dtype
        if is_fp8(kv_cache_dtype) and not self.supports_fp8_kv_cache:
            raise ValueError(f"the {self.name} attention backend has no fp8 KV cache")
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_queries_per_kv = num_heads // num_kv_heads
        self.scale = head_dim**-0.5
        self.dtype = dtype
        self.device = device
        self.kv_cache_dtype = kv_cache_dtype
        self.is_fp8_kv_cache = is_fp8(kv_cache_dtype)

    def with_options(self, options: AttentionOptions) -> AttentionBackend:
        """This backend for a layer that attends with `options` (shares the step's metadata)."""
        if options.has_sinks and not self.supports_sinks:
            raise ValueError(f"the {self.name} attention backend has no attention sinks")
        layer = copy.copy(self)
        layer.options = options
        layer.scale = self.head_dim**-0.5 if options.scale is None else options.scale
        return layer

    def with_sinks(self, sinks: torch.Tensor) -> AttentionBackend:
        """This layer's view with its sink logits [num_heads], as float32."""
        if not self.options.has_sinks or sinks.shape != (self.num_heads,):
            raise ValueError(f"sinks {tuple(sinks.shape)} for a layer of {self.num_heads} heads")
        layer = copy.copy(self)
        layer.sinks = sinks.float()
        return layer

    def with_kv_scales(self, scales: KvScales) -> AttentionBackend:
        """This layer's view with the checkpoint's KV scales (shares the step's metadata)."""
        layer = copy.copy(self)
        layer.kv_scales = scales
        return layer

    @classmethod
    def unsupported_reason(
        cls, device: torch.device, block_size: int | None, dtype: torch.dtype | None = None
    ) -> str | None:
        """Why this backend cannot run here (None when it can); None arguments = not known yet."""
        return None

    def write_kv_rows(
        self,
        kv_cache: torch.Tensor,
        write_index: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> None:
        """Store the step's keys and values at precomputed rows of a cache laid out as
        (key/value, ..., head_dim): row r of the flattened cache is one head of one slot. An
        fp8 cache stores them quantized (divided by the layer's scales, saturated)."""
        key, value = key.reshape(-1, self.head_dim), value.reshape(-1, self.head_dim)
        if self.is_fp8_kv_cache:
            scales = self.kv_scales
            kv_cache = as_bytes(kv_cache)
            key = as_bytes(quantize(key, scales.k_scale, self.kv_cache_dtype))
            value = as_bytes(quantize(value, scales.v_scale, self.kv_cache_dtype))
        rows = kv_cache.view(2, -1, self.head_dim)
        rows[0].index_copy_(0, write_index, key)
        rows[1].index_copy_(0, write_index, value)

    def as_cached(
        self, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's own keys and values as attention reads them back from the cache: with
        an fp8 cache quantized and dequantized (so a prefill attends over what its later
        decodes will read, as vLLM's backends that attend from the cache do), else as they are."""
        if not self.is_fp8_kv_cache:
            return key, value
        scales, dtype = self.kv_scales, self.kv_cache_dtype
        key = dequantize(quantize(key, scales.k_scale, dtype), scales.k_scale, self.dtype)
        value = dequantize(quantize(value, scales.v_scale, dtype), scales.v_scale, self.dtype)
        return key, value

    def read_cached(
        self, rows: torch.Tensor, gather_index: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Rows `gather_index` of one cache half's [rows, width] view, in the compute dtype
        (an fp8 cache's dequantized by `scale`)."""
        if not self.is_fp8_kv_cache:
            return rows.index_select(0, gather_index)
        stored = as_bytes(rows).index_select(0, gather_index).view(self.kv_cache_dtype)
        return dequantize(stored, scale, self.dtype)

    @abstractmethod
    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's cache; dimension 0 is (key, value)."""

    @abstractmethod
    def build_metadata(self, inputs: AttentionInputs) -> object:
        """Device-side indices for the step, shared by every layer."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: object,
    ) -> torch.Tensor:
        """Write key/value [T, kv_heads, D] into the cache, attend query [T, heads, D] -> [T, heads, D]."""


def is_importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


MAX_DECODE_QUERY = 17
"""Longest query of a request with prior context that the CPU backends attend as decodes, one
per query token (speculative decoding's verification: one token plus up to 16 drafts)."""


def split_decodes(inputs: AttentionInputs) -> tuple[AttentionInputs, IntArray, IntArray]:
    """The step's decodes as `(view, entries, prefills)`: `view` describes one decode per entry
    (its token index in `query_start_loc`, its `seq_lens` and `block_tables` row), `entries`
    indexes it, and `prefills` are the requests attended as prefills.

    A request with prior context and a short query (up to MAX_DECODE_QUERY tokens: a
    speculative step's token and drafts) is attended as one decode per query token, each seeing
    the keys up to its own position (the step writes the keys before attending): the same
    arithmetic as decoding those tokens one step at a time, so verifying drafts yields the
    logits decoding would (greedy output stays token-identical in bfloat16 too). Without such
    requests `view` is `inputs` itself and `entries` its one-token queries."""
    query_lens = inputs.query_lens
    is_decode = query_lens == 1
    is_short = (query_lens > 1) & (query_lens <= MAX_DECODE_QUERY) & (inputs.seq_lens > query_lens)
    prefills = np.flatnonzero(~(is_decode | is_short))
    if not is_short.any():
        return inputs, np.flatnonzero(is_decode), prefills
    reqs = np.flatnonzero(is_decode | is_short)
    counts = query_lens[reqs]
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    tokens = np.repeat(inputs.query_start_loc[reqs], counts) + offsets
    seq_lens = np.repeat(inputs.seq_lens[reqs] - counts, counts) + offsets + 1
    view = AttentionInputs(
        query_start_loc=np.append(tokens, inputs.num_tokens),
        seq_lens=seq_lens,
        block_tables=inputs.block_tables[np.repeat(reqs, counts)],
        slot_mapping=inputs.slot_mapping,
        block_size=inputs.block_size,
        null_block_id=inputs.null_block_id,
    )
    return view, np.arange(len(tokens)), prefills

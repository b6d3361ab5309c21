"""KvLayout: what must be equal for one rank's KV blocks to be copied into another's byte for
byte (vLLM's NIXL compatibility factors; kv.v1.KvLayout on the wire)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from splitserve_contracts.engine_options_types import EngineOptions
from worker_svc.runner.model_runner import ModelRunner


@dataclass(frozen=True, slots=True)
class KvLayout:
    """One rank's KV layout; fields as kv.v1.KvLayout."""

    model: str
    """The model's identity: its architecture and weights' source."""
    dtype: str
    kv_cache_dtype: str
    """The cache's dtype, "auto" resolved (e.g. "bfloat16", "float8_e4m3fn")."""
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_layout: str
    """The backend's per-layer cache shape of one block and its name, e.g. "2x1x2x16x64 torch"."""
    tensor_parallel_size: int
    rank: int


COMPARED = tuple(f.name for f in fields(KvLayout) if f.name != "rank")
"""The fields two ranks must agree on (rank i pulls from rank i: the rank is not compared)."""


def layout_differences(mine: KvLayout, theirs: KvLayout) -> list[str]:
    """One entry per differing field, naming both values ("block_size 16 here, 32 there")."""
    return [
        f"{name} {getattr(mine, name)!r} here, {getattr(theirs, name)!r} there"
        for name in COMPARED
        if getattr(mine, name) != getattr(theirs, name)
    ]


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def runner_layout(runner: ModelRunner, options: EngineOptions, block_size: int) -> KvLayout:
    """The layout of a loaded runner's cache of `block_size`-token blocks."""
    backend = runner.backend
    shape = "x".join(str(n) for n in backend.kv_cache_shape(1, block_size))
    model = options.model
    source = model.model + (f"@{model.revision}" if model.revision else "")
    return KvLayout(
        model=f"{runner.model.config.architecture} {source}",
        dtype=_dtype_name(runner.dtype),
        kv_cache_dtype=_dtype_name(runner.kv_cache_spec.dtype),
        block_size=block_size,
        num_layers=runner.kv_cache_spec.num_layers,
        num_kv_heads=runner.kv_cache_spec.num_kv_heads,
        head_dim=runner.kv_cache_spec.head_dim,
        block_layout=f"{shape} {backend.name}",
        tensor_parallel_size=runner.parallel.tp_size,
        rank=runner.parallel.rank,
    )

"""How many bytes the KV cache of a CPU rank gets: vLLM-CPU's rule, capped by what the engine
can use.

1. `--kv-cache-memory-bytes` (the core's flag, sent in GetKvCapacity): exactly that.
2. `VLLM_CPU_KVCACHE_SPACE` (GiB) in the worker's environment, vLLM-CPU's knob: exactly that.
3. Otherwise vLLM-CPU's default fraction (half) of the memory this process can still take - the
   host's MemAvailable, or less when a cgroup limit (a pod's memory limit) leaves less - but
   never more than `max_num_seqs` requests of `max_model_len` tokens can occupy (plus the null
   block): blocks beyond that are never used, and a cache of them makes the KV-usage gauge read
   near 0 % at full load (4 GiB for a 16 MB model did).

The weights are already loaded when this runs, so the memory they take is not counted as free.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
CPU_KV_CACHE_MEMORY_FRACTION = 0.5
"""vLLM-CPU's DEFAULT_CPU_MEM_UTILIZATION."""
KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
NO_LIMIT = 1 << 60  # cgroup v1 writes ~2^63 for "unlimited"


@dataclass(frozen=True, slots=True)
class KvBudget:
    """The KV-cache bytes of one rank and why."""

    num_bytes: int
    reason: str


@dataclass(frozen=True, slots=True)
class EngineShape:
    """What bounds the tokens the engine can hold at once."""

    max_num_seqs: int
    max_model_len: int
    block_size: int

    def num_blocks_usable(self) -> int:
        """Blocks that max_num_seqs requests of max_model_len tokens occupy, plus the null
        block."""
        return self.max_num_seqs * math.ceil(self.max_model_len / self.block_size) + 1


def cpu_kv_budget(
    requested_bytes: int,
    bytes_per_block: int,
    shape: EngineShape,
    environ: Mapping[str, str],
    root: Path = Path("/"),
) -> KvBudget:
    """The KV-cache budget of a CPU rank (see the module docstring); `root` is where /proc
    and /sys are (tests point it at a fake tree)."""
    if requested_bytes > 0:
        return KvBudget(requested_bytes, "--kv-cache-memory-bytes")
    space = environ.get(KV_SPACE_ENV, "").strip()
    if space:
        try:
            gib = float(space)
        except ValueError:
            gib = -1.0
        if not gib > 0:
            raise ValueError(f"{KV_SPACE_ENV}={space!r}: give a positive number of GiB")
        return KvBudget(int(gib * GIB), f"{KV_SPACE_ENV}={space} GiB")
    free, where = available_memory(root)
    budget = int(free * CPU_KV_CACHE_MEMORY_FRACTION)
    usable = shape.num_blocks_usable() * bytes_per_block
    fraction = f"{CPU_KV_CACHE_MEMORY_FRACTION:g} x {free / GIB:.2f} GiB available ({where})"
    if usable <= budget:
        return KvBudget(
            usable,
            f"room for max_num_seqs {shape.max_num_seqs} x max_model_len {shape.max_model_len} "
            f"tokens, the most the engine can use (less than {fraction})",
        )
    return KvBudget(budget, fraction)


def available_memory(root: Path = Path("/")) -> tuple[int, str]:
    """(bytes this process can still allocate, where that figure comes from): MemAvailable,
    or the cgroup's limit minus its working set (usage less inactive file pages, as the
    kubelet counts it) when that is smaller."""
    free = _meminfo_available(root)
    cgroup = _cgroup_room(root)
    if cgroup is not None and cgroup < free:
        return cgroup, "cgroup memory limit"
    return free, "MemAvailable"


def _meminfo_available(root: Path) -> int:
    for line in (root / "proc/meminfo").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            return int(value.split()[0]) * 1024
    raise OSError("no MemAvailable in /proc/meminfo")


def _cgroup_room(root: Path) -> int | None:
    """Limit minus working set of this process's memory cgroup (v2, then v1); None when
    there is no limit or no cgroup to read."""
    layouts = (
        ("sys/fs/cgroup", "memory.max", "memory.current", "inactive_file"),
        (
            "sys/fs/cgroup/memory",
            "memory.limit_in_bytes",
            "memory.usage_in_bytes",
            "total_inactive_file",
        ),
    )
    for folder, limit_file, usage_file, inactive_key in layouts:
        try:
            limit_text = (root / folder / limit_file).read_text().strip()
            usage = int((root / folder / usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or int(limit_text) >= NO_LIMIT:
            return None
        inactive = _stat_value(root / folder / "memory.stat", inactive_key)
        return max(0, int(limit_text) - max(0, usage - inactive))
    return None


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0

"""Which CPUs a rank's threads run on: vLLM's VLLM_CPU_OMP_THREADS_BIND.

A CPU forward is a long run of OpenMP parallel regions, each ending at a barrier: one thread
that the engine core or the frontend preempts holds up the whole team. Binding the ranks to
CPUs of their own, and leaving one to the core and frontend, keeps their wake-ups off the
ranks' cores. Values, read from the worker's environment at start-up and applied when LoadModel
says the rank (`rank` of `world_size`):

* "auto": the CPUs this process may use, split into `world_size` contiguous blocks in rank
  order, after keeping the last CPU back for the engine core and frontend where every rank
  still gets at least `MIN_CPUS_PER_RANK` (vLLM reserves one for its scheduler process). It
  assumes every rank runs on this machine, as `splitserve serve` starts them (which sets it);
* "all" or "nobind" (and unset): no binding; torch's own thread count, any CPU;
* CPU lists, one per rank, ranks separated by "|": "0-3|4-7" puts rank 0 on CPUs 0-3 and rank
  1 on CPUs 4-7; each list of ids and ranges ("0-1,6").

A bound rank's threads, all of them, run on its CPUs only, with one torch thread per CPU unless
--torch-threads says otherwise.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

OMP_THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
AUTO = "auto"
UNBOUND = frozenset({"all", "nobind", ""})
MIN_CPUS_PER_RANK = 2
"""auto keeps a CPU back for the core and frontend only where each rank keeps this many."""


def parse_cpu_list(text: str) -> list[int]:
    """CPU ids of "0-3,6" (sorted, each once); ValueError on anything else."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{part.strip()!r} is not a CPU id or a range like 0-3")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(f"{part.strip()!r}: the range ends before it starts")
        cpus.update(range(low, high + 1))
    return sorted(cpus)


def check_bind(value: str) -> str:
    """`value` if it is a VLLM_CPU_OMP_THREADS_BIND value; ValueError saying why not."""
    if value in UNBOUND or value == AUTO:
        return value
    for i, ranks_cpus in enumerate(value.split("|")):
        try:
            parse_cpu_list(ranks_cpus)
        except ValueError as e:
            raise ValueError(
                f"{OMP_THREADS_BIND_ENV}={value!r}: rank {i}'s CPUs: {e} (expected auto, all, "
                "nobind, or CPU lists per rank separated by '|', like 0-3|4-7)"
            ) from None
    return value


def auto_cpus(allowed: Collection[int], rank: int, world_size: int) -> tuple[list[int], list[int]]:
    """auto's CPUs for `rank`, and the CPUs kept back for the core and frontend (maybe none)."""
    cpus = sorted(allowed)
    kept = cpus[-1:] if len(cpus) - 1 >= MIN_CPUS_PER_RANK * world_size else []
    usable = cpus[: len(cpus) - len(kept)]
    per_rank = len(usable) // world_size
    if per_rank == 0:
        raise ValueError(
            f"{OMP_THREADS_BIND_ENV}=auto: {world_size} ranks on {len(cpus)} CPUs leave rank "
            f"{rank} none; give CPU lists or 'all'"
        )
    return usable[rank * per_rank : (rank + 1) * per_rank], kept


def rank_cpus(value: str, rank: int, world_size: int, allowed: Collection[int]) -> list[int] | None:
    """The CPUs `rank` binds to under `value` (None: unbound); ValueError when it cannot."""
    if value in UNBOUND:
        return None
    if value == AUTO:
        return auto_cpus(allowed, rank, world_size)[0]
    lists = value.split("|")
    if rank >= len(lists):
        raise ValueError(
            f"{OMP_THREADS_BIND_ENV}={value!r} lists CPUs for {len(lists)} ranks; this is rank "
            f"{rank}"
        )
    cpus = parse_cpu_list(lists[rank])
    outside = sorted(set(cpus) - set(allowed))
    if outside:
        raise ValueError(
            f"{OMP_THREADS_BIND_ENV}={value!r}: rank {rank}'s CPUs {outside} are not among the "
            f"CPUs this process may use ({','.join(map(str, sorted(allowed)))})"
        )
    return cpus


@dataclass(frozen=True, slots=True)
class CpuBinding:
    """A worker's VLLM_CPU_OMP_THREADS_BIND and --torch-threads, applied per LoadModel."""

    value: str = "all"
    torch_threads: int = 0
    allowed: tuple[int, ...] = ()
    """The CPUs the process could use at start-up (before any binding of its own)."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], torch_threads: int = 0) -> CpuBinding:
        value = check_bind(environ.get(OMP_THREADS_BIND_ENV, "all").strip())
        return cls(value, torch_threads, tuple(sorted(os.sched_getaffinity(0))))

    def apply(self, rank: int, world_size: int) -> list[int] | None:
        """Bind every thread of this process to `rank`'s CPUs and size torch's thread team to
        them; the CPUs, or None when unbound. ValueError when the value does not fit."""
        cpus = rank_cpus(self.value, rank, world_size, self.allowed or os.sched_getaffinity(0))
        if cpus is None:
            return None
        for task in Path("/proc/self/task").iterdir():
            try:  # threads started later (the step thread, its OpenMP team) inherit it
                os.sched_setaffinity(int(task.name), cpus)
            except ProcessLookupError:
                continue  # it ended meanwhile
        import torch

        torch.set_num_threads(self.torch_threads or len(cpus))
        logger.info(
            "%s=%s: rank %d bound to CPUs %s, %d torch threads",
            OMP_THREADS_BIND_ENV,
            self.value,
            rank,
            ",".join(map(str, cpus)),
            torch.get_num_threads(),
        )
        return cpus

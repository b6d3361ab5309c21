"""Process groups for tensor and pipeline parallelism over torch.distributed.

Rank layout: `rank = pp_rank * tp_size + tp_rank`. Every pipeline stage has its own
tensor-parallel group; pipeline neighbours talk point to point (rank r sends to
r + tp_size), so each tensor-parallel rank of a stage hands its full hidden states to the
same tensor-parallel rank of the next stage. The output rank is the first tensor-parallel rank
of the last stage (`world_size - tp_size`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ParallelState:
    """Where this rank sits and how it talks to its peers.

    With a single rank no process group exists and every collective is the identity.
    """

    rank: int = 0
    tp_size: int = 1
    pp_size: int = 1
    tp_group: dist.ProcessGroup | None = None
    is_initialized: bool = False
    enable_expert_parallel: bool = False
    """MoE layers split whole experts over the TP ranks instead of every expert's rows."""

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def output_rank(self) -> int:
        return self.world_size - self.tp_size

    @property
    def is_output_rank(self) -> bool:
        return self.rank == self.output_rank

    # -- tensor parallel -------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the tensor-parallel group, in place."""
        if self.tp_size > 1:
            dist.all_reduce(tensor, group=self.tp_group)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate the group's tensors along the last dimension, in tp_rank order."""
        if self.tp_size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.tp_size)]
        dist.all_gather(parts, tensor, group=self.tp_group)
        return torch.cat(parts, dim=-1)

    # -- pipeline parallel -----------------------------------------------------------------

    def send_to_next_stage(self, tensors: list[torch.Tensor]) -> None:
        peer = self.rank + self.tp_size
        for tensor in tensors:
            dist.send(tensor.contiguous(), dst=peer)

    def recv_from_prev_stage(
        self, num_tensors: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> list[torch.Tensor]:
        peer = self.rank - self.tp_size
        received = []
        for _ in range(num_tensors):
            tensor = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(tensor, src=peer)
            received.append(tensor)
        return received

    def destroy(self) -> None:
        if self.is_initialized and dist.is_initialized():
            dist.destroy_process_group()
        self.is_initialized = False
        self.tp_group = None


class Rendezvous:
    """The rendezvous store of this worker process, kept across bring-ups.

    Rank 0 hosts one TCPStore for the life of its process; every bring-up (a new engine core
    calling LoadModel on all ranks) meets under its own key prefix. Re-creating the store per
    bring-up would race: a fast rank could join the store a slow rank 0 is still tearing down.
    The other ranks keep their connection to it; one whose host has gone (rank 0's process
    was restarted, hosting a new store) is replaced before the bring-up uses it.
    """

    def __init__(self) -> None:
        self._store: dist.TCPStore | None = None
        self._key: tuple[str, int, bool] | None = None

    def store(
        self, init_method: str, rank: int, rendezvous_id: str, timeout: timedelta
    ) -> dist.Store:
        parsed = urlparse(init_method)
        if parsed.scheme != "tcp" or not parsed.hostname or not parsed.port:
            raise ValueError(
                f"distributed_init_method must be tcp://HOST:PORT, got {init_method!r}"
            )
        key = (parsed.hostname, parsed.port, rank == 0)
        if self._store is not None and self._key == key and not _answers(self._store):
            logger.warning("rendezvous store at %s is gone; connecting afresh", init_method)
            self.forget()
        if self._store is None or self._key != key:
            self._store = dist.TCPStore(
                parsed.hostname,
                parsed.port,
                is_master=rank == 0,
                timeout=timeout,
                wait_for_workers=False,
            )
            self._key = key
        return dist.PrefixStore(f"bring-up/{rendezvous_id or 'default'}", self._store)

    def forget(self) -> None:
        """Drop the store (its host may be gone); the next bring-up connects afresh."""
        self._store, self._key = None, None


def _answers(store: dist.Store) -> bool:
    """Whether the store's host still answers (one round trip)."""
    try:
        store.check(["splitserve/alive"])
    except RuntimeError:  # dist.DistError and the socket errors under it
        return False
    return True


def init_parallel_state(
    rank: int,
    tp_size: int,
    pp_size: int,
    init_method: str,
    device: torch.device,
    timeout_seconds: float = 600.0,
    rendezvous: Rendezvous | None = None,
    rendezvous_id: str = "",
) -> ParallelState:
    """Join the world (all ranks must call this concurrently) and build the TP groups."""
    world_size = tp_size * pp_size
    if tp_size < 1 or pp_size < 1:
        raise ValueError(
            f"tensor_parallel_size and pipeline_parallel_size must be >= 1, "
            f"got {tp_size} and {pp_size}"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    state = ParallelState(rank=rank, tp_size=tp_size, pp_size=pp_size)
    if world_size == 1:
        return state
    if not init_method:
        raise ValueError("distributed_init_method is required when there is more than one rank")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # NCCL binds each rank to its current device
    logger.info("rank %d joining %s world of %d at %s", rank, backend, world_size, init_method)
    timeout = timedelta(seconds=timeout_seconds)
    if rendezvous is None:
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
    else:
        _join(rendezvous, backend, init_method, rank, world_size, rendezvous_id, timeout)
    state.is_initialized = True
    # Every rank must create every group, in the same order.
    for pp_rank in range(pp_size):
        ranks = list(range(pp_rank * tp_size, (pp_rank + 1) * tp_size))
        group = dist.new_group(ranks) if tp_size > 1 else None
        if pp_rank == state.pp_rank:
            state.tp_group = group
    return state


def _join(
    rendezvous: Rendezvous,
    backend: str,
    init_method: str,
    rank: int,
    world_size: int,
    rendezvous_id: str,
    timeout: timedelta,
) -> None:
    """init_process_group, once, on the kept store (Rendezvous.store replaces a dead one).

    Never twice in a row: a failed init_process_group has used up a default group name
    (torch names groups by a per-process counter that only destroy_process_group resets), so
    a second one would meet its peers under another name and wait for them forever. A failure
    resets the counter and drops the store; the core's next bring-up starts clean."""
    store = rendezvous.store(init_method, rank, rendezvous_id, timeout)
    try:
        dist.init_process_group(
            backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
    except BaseException:
        rendezvous.forget()
        _reset_group_names()
        raise


def _reset_group_names() -> None:
    """What destroy_process_group does to the group names "to allow consistent value to be
    generated when we re-create process groups after some trainers recover from failure";
    there is no process group to destroy after a failed init_process_group."""
    if not dist.is_initialized():
        dist.distributed_c10d._world.group_count = 0

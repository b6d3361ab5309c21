"""The rendezvous store a rank keeps across bring-ups, when the rank hosting it (rank 0) is
restarted: the other ranks must meet at the new store, under the names a fresh process uses."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from splitserve.loopback_ports import free_ports
from worker_svc.distributed import Rendezvous, init_parallel_state

TIMEOUT = timedelta(seconds=10)
CPU = torch.device("cpu")


def host_store(port: int) -> dist.TCPStore:
    """The store rank 0's process hosts."""
    return dist.TCPStore("127.0.0.1", port, is_master=True, timeout=TIMEOUT, wait_for_workers=False)


def test_a_store_whose_host_was_restarted_is_replaced() -> None:
    port = free_ports(1)[0]
    url = f"tcp://127.0.0.1:{port}"
    rendezvous = Rendezvous()
    host = host_store(port)
    rendezvous.store(url, 1, "first", TIMEOUT).set("rank1", "here")
    assert host.get("bring-up/first/rank1") == b"here"
    del host  # rank 0's process died; its restart hosts a new store on the same port
    restarted = host_store(port)
    rendezvous.store(url, 1, "second", TIMEOUT).set("rank1", "here")
    assert restarted.get("bring-up/second/rank1") == b"here"


def test_a_failed_join_leaves_the_group_names_of_a_fresh_process() -> None:
    """torch names the default group by a per-process counter; a join that failed (its peer
    never came) must not move it, or the next join waits under a name no fresh peer uses."""
    port = free_ports(1)[0]
    host = host_store(port)
    with pytest.raises(RuntimeError):
        init_parallel_state(
            1, 2, 1, f"tcp://127.0.0.1:{port}", CPU, 1.0, Rendezvous(), rendezvous_id="x"
        )
    del host
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert dist.group.WORLD is not None
        assert dist.group.WORLD.group_name == "0"  # what a fresh process's peers look for
    finally:
        dist.destroy_process_group()

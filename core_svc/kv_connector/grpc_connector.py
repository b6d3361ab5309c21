"""GrpcConnectorScheduler: the engine core's side of the GrpcConnector (registry row
"GrpcConnector"): a producer's ranks serve a finished prompt's KV blocks, a consumer's ranks
pull them over the workers' gRPC port (worker_svc/kv_connector/grpc_connector.py).

Producer (kv_producer; kv_both when the request's params say do_remote_decode): a request that
finished STOP or LENGTH keeps its blocks, leased for `lease_seconds` (kv_connector_extra_config,
default 30), and its final output carries the HANDOFF (core_svc/kv_connector/handoff.py). The
ranks are told (KvSend) and report finished_sending once pulled; a lease that ends first is
released (released_transfer_ids) and the core frees the blocks.

Consumer (kv_consumer, kv_both): a request whose params are a handoff (do_remote_prefill) loads
the prompt beyond its local prefix hit from the producer's ranks (KvLoad) while it waits out of
the running set; the ranks report finished_recving or failed_recving. An aborted load is
cancelled (cancelled_loads) and its blocks are kept until the ranks report it. A producer on the
same host writes the blocks into a shared-memory segment the pull offers instead of the stream
(kv_connector_extra_config.shared_memory, default true; worker_svc/kv_connector/shared_segment.py).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

from core_svc.kv_connector.base import InvalidKVTransferParams, KVConnectorScheduler
from core_svc.kv_connector.handoff import (
    Handoff,
    check_flags,
    flag,
    is_host_port,
    make_handoff,
    parse_handoff,
)
from core_svc.request import Request, RequestStatus
from splitserve_contracts.kv.v1 import kv_transfer_pb2 as kv_pb2
from splitserve_contracts.output_types import KVConnectorOutput

DEFAULT_LEASE_SECONDS = 30.0
"""How long a producer keeps a finished prompt's blocks for its consumer (vLLM's NIXL abort
timeout is 480 s)."""
LEASE_POLL_SECONDS = 0.1
"""The empty steps' interval while only leases are held: a pull's end frees blocks, nobody
waits on it (a load in flight, a handoff to register, polls every `poll_interval`)."""
_HANDED_OFF = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


@dataclass(slots=True)
class _Lease:
    transfer_id: str
    expires_at: float


class GrpcConnectorScheduler(KVConnectorScheduler):
    """See the module docstring."""

    def _configure(self) -> None:
        extra = self.extra_config
        self.worker_addresses = _advertised(extra, self.worker_addresses)
        self.lease_seconds = _lease_seconds(extra)
        if not isinstance(extra.get("shared_memory", True), bool):
            raise ValueError("kv_connector_extra_config.shared_memory must be true or false")
        self.role = self.options.kv_role
        if self.role != "kv_consumer" and not self.worker_addresses:
            raise ValueError(
                f"a {self.role} hands its ranks' addresses to its consumers: give the core "
                "--worker-addrs, or kv_connector_extra_config.advertise_addresses"
            )
        self._pending_loads: dict[int, kv_pb2.KvLoad] = {}
        """Loads recorded, not sent yet (by req_handle)."""
        self._loading: set[int] = set()
        """Loads sent and not reported yet."""
        self._cancelled: list[int] = []
        """Sent loads to cancel with the next metadata."""
        self._cancelling: set[int] = set()
        """Cancelled loads not reported yet."""
        self._pending_sends: list[kv_pb2.KvSend] = []
        self._leases: dict[int, _Lease] = {}
        """Producer: blocks kept for a peer, by req_handle, in the order they expire."""
        self._released: list[str] = []

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params is None:
            return 0, False
        check_flags(params)
        if not params.get("do_remote_prefill") or request.output_token_ids:
            return 0, False  # computed here (a resubmitted request recomputes what it had)
        if self.role == "kv_producer":
            raise InvalidKVTransferParams(
                "kv_transfer_params.do_remote_prefill: this engine is a kv_producer; it loads no "
                "KV (kv_role kv_consumer or kv_both does)"
            )
        self._handoff(request)
        return request.num_prompt_tokens - num_computed_tokens, True

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        if not num_external_tokens:
            return
        handoff = self._handoff(request)
        num_tokens = request.num_prompt_tokens
        first = (num_tokens - num_external_tokens) // self.block_size
        last = -(-num_tokens // self.block_size)
        load = kv_pb2.KvLoad(
            req_handle=request.req_handle,
            transfer_id=handoff.transfer_id,
            remote_engine_id=handoff.remote_engine_id,
        )
        load.local_block_ids.extend(block_ids[first:last])
        load.remote_block_ids.extend(handoff.remote_block_ids[first:])
        load.remote_addresses.extend(handoff.remote_addresses)
        self._pending_loads[request.req_handle] = load

    def build_connector_meta(self) -> bytes:
        if not (self._pending_loads or self._pending_sends or self._released or self._cancelled):
            return b""
        meta = kv_pb2.GrpcConnectorMetadata(
            loads=self._pending_loads.values(),
            sends=self._pending_sends,
            released_transfer_ids=self._released,
            cancelled_loads=self._cancelled,
        )
        self._loading.update(self._pending_loads)
        self._cancelling.update(self._cancelled)
        self._pending_loads, self._pending_sends, self._released, self._cancelled = {}, [], [], []
        return meta.SerializeToString()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        handle = request.req_handle
        if self._pending_loads.pop(handle, None) is not None:
            return False, None  # its load never left: nothing writes its blocks
        if handle in self._loading:
            self._loading.discard(handle)
            self._cancelled.append(handle)
            return True, None  # freed once the ranks report they stopped writing
        if (
            request.status not in _HANDED_OFF
            or request.pooling_task
            or not self._hands_off(request)
        ):
            return False, None
        num_blocks = -(-request.num_prompt_tokens // self.block_size)
        prompt_blocks = block_ids[:num_blocks]
        if len(prompt_blocks) < num_blocks or 0 in prompt_blocks:
            return False, None  # blocks a sliding window dropped: nothing whole to hand off
        lease = _Lease(secrets.token_hex(16), time.time() + self.lease_seconds)
        self._leases[handle] = lease
        send = kv_pb2.KvSend(req_handle=handle, transfer_id=lease.transfer_id)
        send.block_ids.extend(prompt_blocks)
        self._pending_sends.append(send)
        handoff = make_handoff(
            self.engine_id,
            prompt_blocks,
            self.worker_addresses,
            lease.transfer_id,
            request.num_prompt_tokens,
            lease.expires_at,
        )
        return True, handoff

    def _hands_off(self, request: Request) -> bool:
        """kv_producer: every finished prompt; kv_both: those whose params ask
        (do_remote_decode); kv_consumer: none."""
        if self.role == "kv_producer":
            return True
        params = request.kv_transfer_params
        return self.role == "kv_both" and params is not None and flag(params, "do_remote_decode")

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for handle in output.finished_sending:
            self._leases.pop(handle, None)
        if output.finished_sending:
            done = set(output.finished_sending)
            self._pending_sends = [s for s in self._pending_sends if s.req_handle not in done]
        for handle in (*output.finished_recving, *output.failed_recving):
            self._loading.discard(handle)
            self._cancelling.discard(handle)
            self._pending_loads.pop(handle, None)

    def take_expired(self, now: float) -> list[int]:
        expired = []
        for handle, lease in self._leases.items():
            if lease.expires_at > now:
                break  # leases are kept in the order they end
            expired.append(handle)
        for handle in expired:
            self._released.append(self._leases.pop(handle).transfer_id)
        return expired

    def has_pending(self) -> bool:
        return bool(self._leases or self._has_urgent())

    def poll_seconds(self) -> float:
        return self.poll_interval if self._has_urgent() else LEASE_POLL_SECONDS

    def _has_urgent(self) -> bool:
        """Loads a request waits on, or metadata the ranks need (a handoff to serve)."""
        return bool(
            self._pending_loads
            or self._loading
            or self._cancelled
            or self._cancelling
            or self._pending_sends
            or self._released
        )

    def _handoff(self, request: Request) -> Handoff:
        params = request.kv_transfer_params
        assert params is not None
        num_ranks = max(1, len(self.worker_addresses))
        return parse_handoff(
            params,
            request.num_prompt_tokens,
            self.block_size,
            self.engine_id,
            time.time(),
            num_ranks,
        )


def _lease_seconds(extra: dict[str, Any]) -> float:
    value = extra.get("lease_seconds", DEFAULT_LEASE_SECONDS)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(
            f"kv_connector_extra_config.lease_seconds must be a number > 0, got {value!r}"
        )
    return float(value)


def _advertised(extra: dict[str, Any], worker_addresses: list[str]) -> list[str]:
    """Where peers reach the ranks: extra_config advertise_addresses (one per rank), else the
    addresses the core reaches them at."""
    addresses = extra.get("advertise_addresses")
    if addresses is None:
        return list(worker_addresses)
    if not isinstance(addresses, list) or not all(is_host_port(a) for a in addresses):
        raise ValueError(
            'kv_connector_extra_config.advertise_addresses must be a list of "host:port"'
        )
    if worker_addresses and len(addresses) != len(worker_addresses):
        raise ValueError(
            f"kv_connector_extra_config.advertise_addresses lists {len(addresses)} ranks; the "
            f"engine has {len(worker_addresses)}"
        )
    return list(addresses)

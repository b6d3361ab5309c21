"""The consumer's loads: each KvLoad pulls its blocks from the producer's same rank on a small
thread pool (never on the step thread), writing every chunk into its layer at the local blocks
after checking it (its bytes come in the stream, or in a shared-memory segment the pull offered
a producer on this host: shared_segment.py); a cancelled load stops between chunks. Each load
reports exactly once: finished_recving, or failed_recving with a reason ("cancelled" for a
cancelled one)."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import grpc

from splitserve_contracts.kv.v1 import kv_transfer_pb2 as kv_pb
from splitserve_contracts.kv.v1 import kv_transfer_pb2_grpc as kv_grpc
from splitserve_runtime.channels import ChannelSecurity, open_channel
from worker_svc.kv_connector.block_io import BlockIO
from worker_svc.kv_connector.chunk_writer import ChunkWriter, LoadFailed
from worker_svc.kv_connector.kv_convert import KvLoad, layout_to_proto
from worker_svc.kv_connector.layout import KvLayout
from worker_svc.kv_connector.reports import Reports
from worker_svc.kv_connector.shared_segment import SegmentPool, host_identity, segment_offset

logger = logging.getLogger(__name__)

PULL_THREADS = 2
PULL_TIMEOUT_SECONDS = 120.0
HANDSHAKE_TIMEOUT_SECONDS = 10.0
CHUNK_BYTES = 4 << 20
REMEMBERED_LOADS = 4096
"""Ended loads kept so that cancelling one after it reported adds no second report."""


@dataclass(slots=True)
class _Load:
    load: KvLoad
    cancelled: threading.Event = field(default_factory=threading.Event)
    call: Any = None
    """The call in progress (KvHandshake, then PullKv), cancelled from the step thread."""


class Pulls:
    """The rank's loads in progress. start/cancel from the step thread; reports to `reports`."""

    def __init__(
        self,
        blocks: BlockIO,
        layout: KvLayout,
        security: ChannelSecurity,
        reports: Reports,
        shared_memory: bool = True,
    ) -> None:
        self.blocks, self.layout, self.security, self.reports = blocks, layout, security, reports
        self.shared_memory = shared_memory
        """Offer producers on this host a shared-memory segment (shared_segment.py)."""
        self.segments = SegmentPool()
        self._pool = ThreadPoolExecutor(PULL_THREADS, thread_name_prefix="kv-pull")
        self._lock = threading.Lock()
        self._active: dict[int, _Load] = {}
        self._ended: OrderedDict[int, None] = OrderedDict()
        self._channels: dict[str, grpc.Channel] = {}
        self._shaken: set[str] = set()

    def start(self, load: KvLoad) -> None:
        state = _Load(load)
        with self._lock:
            self._active[load.req_handle] = state
        self._pool.submit(self._run, state)

    def cancel(self, req_handles: Iterable[int]) -> None:
        """Cancel these loads (their failed_recving "cancelled" follows once they stopped
        writing); a handle this rank never loaded is reported at once."""
        for handle in req_handles:
            with self._lock:
                state = self._active.get(handle)
                is_ended = handle in self._ended
            if state is not None:
                state.cancelled.set()
                if state.call is not None:
                    state.call.cancel()
            elif not is_ended:
                self.reports.failed(handle, "cancelled")

    def _run(self, state: _Load) -> None:
        handle, started = state.load.req_handle, time.perf_counter()
        try:
            num_bytes = self._pull(state)
            if state.cancelled.is_set():
                raise LoadFailed("cancelled")
        except LoadFailed as e:
            self._end(handle, str(e))
        except grpc.RpcError as e:
            reason = "cancelled" if state.cancelled.is_set() else _rpc_reason("PullKv", e)
            self._end(handle, reason)
        except Exception as e:  # noqa: BLE001 (the load fails; the engine core recomputes)
            logger.exception("KV load of request %d failed", handle)
            self._end(handle, f"{type(e).__name__}: {e}")
        else:
            self._end(handle, None)
            self.reports.received(handle, num_bytes, time.perf_counter() - started)

    def _end(self, handle: int, failure: str | None) -> None:
        with self._lock:
            self._active.pop(handle, None)
            self._ended[handle] = None
            while len(self._ended) > REMEMBERED_LOADS:
                self._ended.popitem(last=False)
        if failure is not None:
            logger.warning("KV load of request %d failed: %s", handle, failure)
            self.reports.failed(handle, failure)

    def _pull(self, state: _Load) -> int:
        """Pull and write the load's blocks; returns the bytes written."""
        load, rank = state.load, self.layout.rank
        if rank >= len(load.remote_addresses):
            raise LoadFailed(f"remote_addresses has no address for rank {rank}")
        problem = self.blocks.id_problem(load.local_block_ids)
        if problem is not None:
            raise LoadFailed(f"local_block_ids: {problem}")
        channel = self._handshake(load.remote_addresses[rank], state)
        num_blocks = len(load.local_block_ids)
        segment = self._offer_segment(num_blocks)
        is_clean = False
        request = kv_pb.PullKvRequest(
            transfer_id=load.transfer_id,
            engine_id=load.remote_engine_id,
            block_ids=load.remote_block_ids,
            max_chunk_bytes=CHUNK_BYTES,
            shared_memory_name=segment.name if segment is not None else "",
            host_identity=host_identity() if segment is not None else "",
        )
        call = kv_grpc.KvTransferServiceStub(channel).PullKv(
            request, timeout=PULL_TIMEOUT_SECONDS, metadata=self.security.call_metadata()
        )
        state.call = call
        writer = ChunkWriter(self.blocks, load.local_block_ids)
        try:
            if state.cancelled.is_set():
                call.cancel()
            for chunk in call:
                if state.cancelled.is_set():
                    call.cancel()
                    raise LoadFailed("cancelled")
                data = self._chunk_data(chunk, segment, num_blocks)
                writer.write(chunk.layer, chunk.first_block, chunk.num_blocks, data)
                del data  # a view of the segment: released before it closes
            writer.check_complete()
            is_clean = True
        finally:
            if segment is not None:  # a pull that did not end may still be written: retired
                self.segments.give_back(segment, is_clean)
        self.blocks.synchronize()
        return writer.num_bytes

    def _offer_segment(self, num_blocks: int) -> SharedMemory | None:
        """A segment for the producer to write this pull into, when same-host delivery is on
        (kv_connector_extra_config.shared_memory, default on) and /dev/shm can hold it."""
        if not self.shared_memory or not host_identity():
            return None
        return self.segments.take(self.blocks.num_layers * num_blocks * self.blocks.block_bytes)

    def _chunk_data(
        self, chunk: kv_pb.PullKvResponse, segment: SharedMemory | None, num_blocks: int
    ) -> bytes | memoryview:
        """The chunk's bytes: in the stream, or where the producer wrote them in `segment`
        (ChunkWriter checks their length and place)."""
        if not chunk.in_shared_memory:
            return chunk.data
        if segment is None or segment.buf is None or chunk.data:
            raise LoadFailed("a chunk in shared memory this pull did not offer, or in both")
        block_bytes = self.blocks.block_bytes
        start = segment_offset(chunk.layer, chunk.first_block, num_blocks, block_bytes)
        return segment.buf[start : start + chunk.num_blocks * block_bytes]

    def _handshake(self, address: str, state: _Load) -> grpc.Channel:
        """The channel to `address`, after one KvHandshake per address (cached once it
        matched); LoadFailed when the layouts differ, the peer does not answer, or the load is
        cancelled meanwhile (the call is `state.call` until then: a cancel ends it at once)."""
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = open_channel(address, self.security)
            if address in self._shaken:
                return channel
        call = kv_grpc.KvTransferServiceStub(channel).KvHandshake.future(
            kv_pb.KvHandshakeRequest(layout=layout_to_proto(self.layout)),
            timeout=HANDSHAKE_TIMEOUT_SECONDS,
            metadata=self.security.call_metadata(),
        )
        state.call = call
        if state.cancelled.is_set():
            call.cancel()
        try:
            call.result()
        except grpc.FutureCancelledError:
            raise LoadFailed("cancelled") from None
        except grpc.RpcError as e:
            raise LoadFailed(_rpc_reason(f"KvHandshake with {address}", e)) from None
        with self._lock:
            self._shaken.add(address)
        return channel

    def shutdown(self) -> None:
        """Cancel every load, wait for the threads, close the channels."""
        self.cancel(list(self._active))
        self._pool.shutdown(wait=True, cancel_futures=False)
        for channel in self._channels.values():
            channel.close()
        self.segments.close()


def _rpc_reason(what: str, error: grpc.RpcError) -> str:
    code = error.code() if isinstance(error, grpc.Call) else None
    details = error.details() if isinstance(error, grpc.Call) else str(error)
    return f"{what}: {code.name if code is not None else 'error'}: {details}"

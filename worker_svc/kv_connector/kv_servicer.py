"""KvTransferService on a producer rank's gRPC port: the layout handshake, and PullKv streaming
a leased transfer's blocks layer by layer (read lazily, one chunk at a time: the sync server
sends each chunk before it asks for the next, so memory stays one chunk per pull and gRPC's
flow control paces the stream). A caller on this host may offer a shared-memory segment
(shared_segment.py): the chunks' bytes go there and the stream carries their headers."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import grpc

from splitserve_contracts.kv.v1 import kv_transfer_pb2 as kv_pb
from splitserve_contracts.kv.v1 import kv_transfer_pb2_grpc as kv_grpc
from worker_svc.kv_connector.block_io import BlockIO
from worker_svc.kv_connector.kv_convert import layout_from_proto, layout_to_proto
from worker_svc.kv_connector.layout import KvLayout, layout_differences
from worker_svc.kv_connector.sends import PullRefused, SendRegistry
from worker_svc.kv_connector.shared_segment import (
    MappedSegment,
    host_identity,
    open_segment,
    segment_offset,
)

REGISTRATION_WAIT_SECONDS = 2.0
"""How long PullKv waits for a transfer whose KvSend is still on its way (the handoff reaches
the consumer with the finished request; the registration rides the producer's next step)."""
DEFAULT_CHUNK_BYTES = 4 << 20
MAX_CHUNK_BYTES = 64 << 20


class KvTransferServicer(kv_grpc.KvTransferServiceServicer):
    """Serves one rank's leased blocks (`sends`) of cache `blocks` in layout `layout`."""

    def __init__(
        self, engine_id: str, layout: KvLayout, sends: SendRegistry, blocks: BlockIO
    ) -> None:
        self.engine_id = engine_id
        self.layout = layout
        self.sends = sends
        self.blocks = blocks

    def KvHandshake(
        self, request: kv_pb.KvHandshakeRequest, context: grpc.ServicerContext
    ) -> kv_pb.KvHandshakeResponse:
        differences = layout_differences(self.layout, layout_from_proto(request.layout))
        if differences:
            _abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"KV layouts differ (producer here, consumer there): {'; '.join(differences)}",
            )
        return kv_pb.KvHandshakeResponse(
            layout=layout_to_proto(self.layout), engine_id=self.engine_id
        )

    def PullKv(
        self, request: kv_pb.PullKvRequest, context: grpc.ServicerContext
    ) -> Iterator[kv_pb.PullKvResponse]:
        block_ids = list(request.block_ids)
        try:
            blocks_per_chunk = self._check_pull(request, block_ids)
            transfer = self.sends.claim(request.transfer_id, block_ids, REGISTRATION_WAIT_SECONDS)
        except PullRefused as e:
            _abort(context, e.code, str(e))
        context.add_callback(lambda: self.sends.done(transfer))  # also on cancel
        segment = self._segment(request, len(block_ids))
        try:
            for layer, first, ids in self.blocks.chunk_ranges(block_ids, blocks_per_chunk):
                data = self._chunk_bytes(segment, layer, first, ids, len(block_ids))
                if transfer.released.is_set():  # after the read: a read the freeing overlapped
                    _abort(
                        context,
                        grpc.StatusCode.NOT_FOUND,
                        f"transfer {request.transfer_id}: its lease ended during the pull",
                    )
                yield kv_pb.PullKvResponse(
                    layer=layer,
                    first_block=first,
                    num_blocks=len(ids),
                    data=data,
                    in_shared_memory=segment is not None,
                )
        finally:
            self.sends.done(transfer)
            if segment is not None:
                segment.close()

    def _segment(self, request: kv_pb.PullKvRequest, num_blocks: int) -> MappedSegment | None:
        """The caller's shared-memory segment, when it offers one this rank can write."""
        if not request.shared_memory_name or request.host_identity != host_identity():
            return None
        size = self.blocks.num_layers * num_blocks * self.blocks.block_bytes
        return open_segment(request.shared_memory_name, size)

    def _chunk_bytes(
        self,
        segment: MappedSegment | None,
        layer: int,
        first: int,
        ids: Sequence[int],
        num_blocks: int,
    ) -> bytes:
        """The chunk's bytes for the stream, or b"" once written into `segment`."""
        if segment is None:
            return self.blocks.read(layer, ids)
        block_bytes, buffer = self.blocks.block_bytes, segment.buf
        start = segment_offset(layer, first, num_blocks, block_bytes)
        self.blocks.read_into(layer, ids, buffer[start : start + len(ids) * block_bytes])
        return b""

    def _check_pull(self, request: kv_pb.PullKvRequest, block_ids: Sequence[int]) -> int:
        """Blocks per chunk of a valid request; PullRefused names what is wrong."""
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        if request.engine_id != self.engine_id:
            raise PullRefused(
                invalid, f"engine_id {request.engine_id!r} is not this engine ({self.engine_id!r})"
            )
        problem = self.blocks.id_problem(block_ids)
        if problem is not None:
            raise PullRefused(invalid, f"block_ids: {problem}")
        max_bytes = request.max_chunk_bytes or DEFAULT_CHUNK_BYTES
        block_bytes = max(self.blocks.block_bytes, 1)
        if not block_bytes <= max_bytes <= MAX_CHUNK_BYTES:
            raise PullRefused(
                invalid,
                f"max_chunk_bytes {max_bytes} outside {block_bytes}..{MAX_CHUNK_BYTES} "
                "(one block of one layer .. 64 MiB)",
            )
        return max_bytes // block_bytes


def kv_transfer_handlers(servicer: KvTransferServicer) -> tuple[grpc.GenericRpcHandler, ...]:
    """The servicer's method handlers, for a port that binds them after it started
    (worker_svc/kv_connector/service_slot.py)."""
    collected = _HandlerCollector()
    kv_grpc.add_KvTransferServiceServicer_to_server(servicer, collected)
    return tuple(collected.handlers)


class _HandlerCollector:
    """Stands in for a server: keeps the generic handlers the generated code adds."""

    def __init__(self) -> None:
        self.handlers: list[grpc.GenericRpcHandler] = []

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self.handlers.extend(handlers)

    def add_registered_method_handlers(self, name: str, handlers: dict[str, Any]) -> None:
        """Registered methods are an optimisation of a started server's lookup: skipped."""


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    context.abort(code, message)
    raise AssertionError("context.abort returned")

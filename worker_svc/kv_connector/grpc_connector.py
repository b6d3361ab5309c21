"""GrpcConnectorWorker: the ranks' side of the GrpcConnector (prefill/decode disaggregation).

Producer: the step's metadata registers the blocks of finished prefills (KvSend) under their
transfer ids; the rank's KvTransferService streams them to the consumer's same rank (PullKv)
and, once that stream ends or is cancelled, the next output reports finished_sending so the
engine core frees them; released_transfer_ids (the lease ended) stop serving them.
Consumer: each KvLoad starts a background pull (pulls.py) whose end the next output reports
(finished_recving with bytes and seconds, or failed_recving with a reason); cancelled_loads
stop a pull between chunks.

The blocks move whole, before (consumer) or after (producer) the requests' steps: the engine
core parks a loading request until its load finished, and serves a prefill's blocks once it
finished, so the per-layer hooks (wait_for_layer_load, save_kv_layer) have nothing to do.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import grpc

from splitserve_contracts.output_types import KVConnectorOutput
from worker_svc.kv_connector.base import ConnectorContext, KVConnectorWorker
from worker_svc.kv_connector.block_io import BlockIO
from worker_svc.kv_connector.kv_convert import NO_META, connector_meta_from_bytes
from worker_svc.kv_connector.kv_servicer import KvTransferServicer, kv_transfer_handlers
from worker_svc.kv_connector.pulls import Pulls
from worker_svc.kv_connector.reports import Reports
from worker_svc.kv_connector.sends import SendRegistry


class GrpcConnectorWorker(KVConnectorWorker):
    """One rank's GrpcConnector: serves its leased blocks and pulls its loads."""

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        kv_cache, layout, security = context.kv_cache, context.layout, context.security
        self.blocks = BlockIO(kv_cache)
        self.reports = Reports()
        self.sends = SendRegistry(self.reports)
        extra = json.loads(context.options.kv_connector_extra_config or "{}")
        shared_memory = extra.get("shared_memory", True) is not False  # checked by the core
        self.pulls = Pulls(self.blocks, layout, security, self.reports, shared_memory)
        self.servicer = KvTransferServicer(context.engine_id, layout, self.sends, self.blocks)
        self._meta = NO_META

    def bind_connector_metadata(self, meta: bytes) -> None:
        """Registers the step's sends and drops released transfers at once (a pull waiting for
        its registration goes on)."""
        self._meta = connector_meta_from_bytes(meta)
        if self._meta.sends:
            self.sends.register(self._meta.sends)
        if self._meta.released_transfer_ids:
            self.sends.release(self._meta.released_transfer_ids)

    def start_load_kv(self) -> None:
        for load in self._meta.loads:
            self.pulls.start(load)
        if self._meta.cancelled_loads:
            self.pulls.cancel(self._meta.cancelled_loads)

    def get_finished(self, finished_req_handles: Sequence[int]) -> KVConnectorOutput | None:
        return self.reports.take()

    def clear_connector_metadata(self) -> None:
        self._meta = NO_META

    def servicers(self) -> Sequence[grpc.GenericRpcHandler]:
        return kv_transfer_handlers(self.servicer)

    def shutdown(self) -> None:
        self.sends.close()
        self.pulls.shutdown()

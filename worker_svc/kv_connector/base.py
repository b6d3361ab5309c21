"""KVConnectorWorker: the ranks' side of a KV connector (vLLM's KVConnectorBase_V1, worker role).

The engine core's side (core_svc/kv_connector/base.py, KVConnectorScheduler) decides what moves
and sends it to every rank as the step's `kv_connector_metadata` (bytes in the connector's own
encoding); the rank's side moves the blocks and reports what finished in the step's
`ModelRunnerOutput.kv_connector_output`. One step, in the model runner's order:

    bind_connector_metadata(meta) -> start_load_kv() -> [wait_for_layer_load(i) ... forward ...
    save_kv_layer(i)] -> wait_for_save() -> get_finished(finished) -> clear_connector_metadata()

A step with no scheduled tokens runs the same hooks without a forward. An engine without a
connector has no connector object: the step path makes one None check.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from splitserve_contracts.engine_options_types import KVTransferOptions
from splitserve_contracts.output_types import KVConnectorOutput
from splitserve_runtime.channels import ChannelSecurity
from worker_svc.kv_connector.layout import KvLayout
from worker_svc.runner.kv_cache import PagedKVCache


@dataclass(frozen=True, slots=True)
class ConnectorContext:
    """What a rank's connector is built with: the engine's kv_transfer group, this engine's id
    among the engines that exchange KV, this rank, its blocks' layout, the blocks, and how it
    reaches other engines' ranks (the internal hops' mutual TLS)."""

    options: KVTransferOptions
    engine_id: str
    rank: int
    layout: KvLayout
    kv_cache: PagedKVCache
    security: ChannelSecurity


class KVConnectorWorker(ABC):
    """One rank's connector, constructed complete once the rank's KV cache exists."""

    def __init__(self, context: ConnectorContext) -> None:
        self.context = context
        self.engine_id = context.engine_id
        self.layout = context.layout

    @abstractmethod
    def bind_connector_metadata(self, meta: bytes) -> None:
        """The step's metadata (vLLM's bind_connector_metadata), before the forward; b"": none."""

    @abstractmethod
    def start_load_kv(self) -> None:
        """Start the loads the metadata asked for (vLLM's start_load_kv); must not block."""

    def wait_for_layer_load(self, layer: int) -> None:  # noqa: B027 (optional hook)
        """Block until layer `layer`'s KV is loaded (vLLM's wait_for_layer_load); a connector
        that loads whole requests before they are scheduled has nothing to wait for."""

    def save_kv_layer(self, layer: int) -> None:  # noqa: B027 (optional hook)
        """Layer `layer` wrote its KV this step (vLLM's save_kv_layer); a connector that serves
        finished requests' blocks from the cache has nothing to save."""

    def wait_for_save(self) -> None:  # noqa: B027 (optional hook)
        """Block until this step's saves are done (vLLM's wait_for_save), after the forward."""

    @abstractmethod
    def get_finished(self, finished_req_handles: Sequence[int]) -> KVConnectorOutput | None:
        """The transfers finished since the previous call (vLLM's get_finished); None: none.
        `finished_req_handles` are the requests the step finished."""

    def clear_connector_metadata(self) -> None:  # noqa: B027 (optional hook)
        """The step is over (vLLM's clear_connector_metadata)."""

    def servicers(self) -> Sequence[grpc.GenericRpcHandler]:
        """What this connector serves on the rank's gRPC port (GrpcConnector: KvTransferService);
        the port admits only other engines' ranks (splitserve_runtime.tls.WORKER_ROLE)."""
        return ()

    @abstractmethod
    def shutdown(self) -> None:
        """Stop transfers in progress (vLLM's shutdown); the rank is dropping its cache."""

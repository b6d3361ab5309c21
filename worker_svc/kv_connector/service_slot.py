"""ConnectorServices: the worker port's slot for a KV connector's services.

A gRPC server takes its services before it starts, and the connector exists only once the rank
loaded its model and allocated its cache (InitializeKvCache). The slot is added to the server
at start-up and serves whatever the current connector binds; with none bound, its methods
answer UNIMPLEMENTED as any unknown method does.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc


class ConnectorServices(grpc.GenericRpcHandler):
    """Dispatches to the bound connector's handlers (KVConnectorWorker.servicers())."""

    def __init__(self) -> None:
        self._handlers: tuple[grpc.GenericRpcHandler, ...] = ()

    def bind(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        """Serve `handlers` from now on (() unbinds)."""
        self._handlers = tuple(handlers)

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        for handlers in self._handlers:
            handler = handlers.service(handler_call_details)
            if handler is not None:
                return handler
        return None

"""RankKvConnector: a rank's KV connector seam, as the Worker holds it: the port's service slot
(there from start-up) and the connector (built once the cache exists, dropped with it)."""

from __future__ import annotations

from splitserve_contracts.engine_options_types import EngineOptions
from splitserve_runtime.channels import ChannelSecurity
from splitserve_runtime.tls import WORKER_ROLE
from worker_svc.kv_connector.base import KVConnectorWorker
from worker_svc.kv_connector.factory import build_kv_connector
from worker_svc.kv_connector.service_slot import ConnectorServices
from worker_svc.runner.model_runner import ModelRunner


class RankKvConnector:
    """`security`: how the connector reaches other engines' ranks (default plaintext)."""

    def __init__(self, security: ChannelSecurity | None = None) -> None:
        self.security = security or ChannelSecurity(None, WORKER_ROLE)
        self.services = ConnectorServices()
        """Added to the rank's gRPC server at start-up; serves the current connector's
        services."""
        self.connector: KVConnectorWorker | None = None

    def start(self, options: EngineOptions, runner: ModelRunner) -> None:
        """Build the configured connector for `runner`'s cache (none without kv_transfer)."""
        self.stop()
        self.connector = build_kv_connector(options, runner, self.security)
        if self.connector is not None:
            self.services.bind(self.connector.servicers())

    def stop(self) -> None:
        if self.connector is not None:
            self.services.bind(())
            self.connector.shutdown()
            self.connector = None

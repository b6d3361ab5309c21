"""The ranks' KV connector, built from LoadModel's options (kv_transfer group) once the rank's
cache exists; None without the group: no connector object, today's step path."""

from __future__ import annotations

import logging

from splitserve_contracts.engine_options_types import EngineOptions
from splitserve_runtime.channels import ChannelSecurity
from splitserve_runtime.kv_connector_names import connector_class, kv_engine_id
from worker_svc.kv_connector.base import ConnectorContext, KVConnectorWorker
from worker_svc.kv_connector.layout import runner_layout
from worker_svc.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def build_kv_connector(
    options: EngineOptions, runner: ModelRunner, security: ChannelSecurity
) -> KVConnectorWorker | None:
    """The configured connector's worker side for `runner` (its cache allocated), or None.
    The engine id is kv_transfer.kv_engine_id (the engine core fills it in when it chose one)."""
    transfer = options.kv_transfer
    if transfer is None or not transfer.kv_connector:
        return None
    kv_cache = runner.kv_cache
    if kv_cache is None:
        raise RuntimeError("the KV connector needs the rank's KV cache")
    row, cls = connector_class(transfer, "worker", KVConnectorWorker)
    engine_id = kv_engine_id(transfer, "this rank")
    layout = runner_layout(runner, options, kv_cache.block_size)
    connector: KVConnectorWorker = cls(
        ConnectorContext(transfer, engine_id, layout.rank, layout, kv_cache, security)
    )
    logger.info(
        "KV connector %s (%s) on rank %d, engine id %s, layout %s",
        row.name,
        transfer.kv_role,
        layout.rank,
        engine_id,
        layout,
    )
    return connector

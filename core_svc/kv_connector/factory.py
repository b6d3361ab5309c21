"""Build the engine core's KV connector from the options' kv_transfer group (vLLM's
KVConnectorFactory, scheduler role): the registry row (splitserve_runtime/kv_connector_names.py)
names the class; no group, no connector."""

from __future__ import annotations

import logging
import uuid
from dataclasses import replace

from core_svc.kv_connector.base import KVConnectorScheduler
from splitserve_contracts.engine_options_types import EngineOptions, KVTransferOptions
from splitserve_runtime.kv_connector_names import connector_class, kv_engine_id

logger = logging.getLogger(__name__)


def with_kv_engine_id(options: EngineOptions) -> EngineOptions:
    """The options with kv_transfer.kv_engine_id chosen when "" (vLLM: a random uuid4 hex at
    start), so the ranks, which get these options, know the same id as the core."""
    transfer = options.kv_transfer
    if transfer is None or transfer.kv_engine_id:
        return options
    return replace(options, kv_transfer=replace(transfer, kv_engine_id=uuid.uuid4().hex))


def kv_connector_settings_problem(
    options: EngineOptions, worker_addresses: list[str]
) -> str | None:
    """Why the connector kv_transfer names refuses its settings (kv_connector_extra_config,
    the addresses it hands out), or None: the flags are refused before the ranks come up."""
    try:
        create_kv_connector(options.kv_transfer, options.cache.block_size, worker_addresses)
    except ValueError as err:
        return str(err)
    return None


def create_kv_connector(
    transfer: KVTransferOptions | None, block_size: int, worker_addresses: list[str]
) -> KVConnectorScheduler | None:
    """The connector kv_transfer names (None without the group). An engine id still "" (options
    that did not pass `with_kv_engine_id`) gets one of its own here. ValueError: the connector
    refused its settings."""
    if transfer is None:
        return None
    row, cls = connector_class(transfer, "scheduler", KVConnectorScheduler)
    engine_id = kv_engine_id(transfer, "the engine core")
    connector: KVConnectorScheduler = cls(transfer, engine_id, block_size, list(worker_addresses))
    logger.info(
        "KV connector %s (%s), engine id %s", row.name, transfer.kv_role, connector.engine_id
    )
    return connector

"""The KV connectors' registry, and vLLM's `--kv-transfer-config` read into the options' group.

One row per connector a `kv_transfer.kv_connector` may name (vLLM's KVConnectorFactory names):
its two sides as "module:Class" paths, the engine core's (KVConnectorScheduler, imported only by
the core: no torch) and the ranks' (KVConnectorWorker, imported only by the workers). This module
imports neither, so the engine core (the flag, the rules) and the ranks read the same table. A
connector is its modules plus one row here; a connector outside this build is a module that
defines a `KV_CONNECTOR` row, named by `kv_connector_module_path` (vLLM's key).
"""

from __future__ import annotations

import importlib
import json
import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from splitserve_contracts.engine_options_types import KVTransferOptions
from splitserve_contracts.json_object import parse_json_object


@dataclass(frozen=True, slots=True)
class KVConnector:
    """One registry row: vLLM's name, the connector's two sides and what `--help` says."""

    name: str
    scheduler_class: str
    """The engine core's side ("module:Class", a core_svc.kv_connector.base.KVConnectorScheduler)."""
    worker_class: str
    """The ranks' side ("module:Class", a worker_svc.kv_connector.base.KVConnectorWorker)."""
    help: str


CONNECTORS: tuple[KVConnector, ...] = (
    KVConnector(
        "GrpcConnector",
        "core_svc.kv_connector.grpc_connector:GrpcConnectorScheduler",
        "worker_svc.kv_connector.grpc_connector:GrpcConnectorWorker",
        "a producer's ranks serve a finished prefill's KV blocks to the consumer's same ranks over "
        "the workers' gRPC port (mutual TLS as every internal hop); prefill/decode disaggregation",
    ),
)
"""The registry (vLLM's names)."""

KV_CONNECTOR_NAMES = tuple(c.name for c in CONNECTORS)
"""The names `kv_transfer.kv_connector` accepts."""

logger = logging.getLogger(__name__)

_KEYS = {
    "kv_connector": "kv_connector",
    "kv_role": "kv_role",
    "kv_connector_extra_config": "kv_connector_extra_config",
    "engine_id": "kv_engine_id",
    "kv_connector_module_path": "kv_connector_module_path",
}
"""vLLM's KVTransferConfig keys this engine reads -> the KVTransferOptions field each fills."""


class InvalidKVTransferConfig(ValueError):
    """A --kv-transfer-config that is no JSON object of the keys this engine reads."""


def kv_connector_problem(name: str, module_path: str = "") -> str | None:
    """None when `name` is a registered connector (or the one `module_path` defines), else what
    is wrong with it."""
    try:
        find_connector(name, module_path)
    except LookupError as e:
        return str(e)
    return None


def find_connector(name: str, module_path: str = "") -> KVConnector:
    """The row of connector `name`: the registry's, or the KV_CONNECTOR row of `module_path`
    (vLLM's kv_connector_module_path). LookupError says what is wrong."""
    if module_path:
        try:
            row = getattr(importlib.import_module(module_path), "KV_CONNECTOR", None)
        except ImportError as e:
            raise LookupError(
                f"kv_connector_module_path {module_path!r} cannot be imported: {e}"
            ) from e
        if not isinstance(row, KVConnector) or row.name != name:
            raise LookupError(
                f"kv_connector_module_path {module_path!r} defines no KV_CONNECTOR row named {name!r}"
            )
        return row
    for row in CONNECTORS:
        if row.name == name:
            return row
    raise LookupError(f"is {name!r}; choose one of {', '.join(KV_CONNECTOR_NAMES)}")


def load_class(path: str) -> type:
    """The class a row's "module:Class" path names (imported now)."""
    module, _, name = path.partition(":")
    cls = getattr(importlib.import_module(module), name)
    if not isinstance(cls, type):
        raise TypeError(f"{path} is no class")
    return cls


def connector_class(
    transfer: KVTransferOptions, side: Literal["scheduler", "worker"], base: type
) -> tuple[KVConnector, type]:
    """The registry row `transfer` names and its `side`'s class, checked to be a `base`
    (TypeError otherwise); each side imports only its own."""
    row = find_connector(transfer.kv_connector, transfer.kv_connector_module_path)
    path = row.scheduler_class if side == "scheduler" else row.worker_class
    cls = load_class(path)
    if not issubclass(cls, base):
        raise TypeError(f"{path} is no {base.__name__}")
    return row, cls


def kv_engine_id(transfer: KVTransferOptions, chooser: str) -> str:
    """kv_transfer.kv_engine_id, or, when it is "", a uuid4 hex `chooser` (who reads it) picks,
    with a warning: vLLM's default."""
    if transfer.kv_engine_id:
        return transfer.kv_engine_id
    engine_id = uuid.uuid4().hex
    logger.warning("kv_transfer.kv_engine_id is empty: %s chose %s", chooser, engine_id)
    return engine_id


def parse_kv_transfer_config(text: str) -> KVTransferOptions | None:
    """--kv-transfer-config: vLLM's JSON object; "", "{}" or "null": no connector."""
    value = parse_json_object(text, InvalidKVTransferConfig)
    return None if value is None else kv_transfer_options(value)


def kv_transfer_options(value: Mapping[str, Any]) -> KVTransferOptions:
    """vLLM's kv_transfer_config keys (a dict, as vLLM's LLM takes it) as the options' group;
    unknown keys and values of the wrong type are refused. Not validated (the rules do)."""
    unknown = set(value) - set(_KEYS)
    if unknown:
        raise InvalidKVTransferConfig(
            f"unknown keys {sorted(unknown)}; this engine reads {sorted(_KEYS)}"
        )
    fields: dict[str, str] = {}
    for key, name in _KEYS.items():
        item = value.get(key)
        if key == "kv_connector_extra_config":
            if item is not None and not isinstance(item, dict):
                raise InvalidKVTransferConfig(f"{key} must be a JSON object")
            fields[name] = json.dumps(item, sort_keys=True) if item else ""
        elif item is not None and not isinstance(item, str):
            raise InvalidKVTransferConfig(f"{key} must be a string, got {item!r}")
        else:
            fields[name] = item or ""
    return KVTransferOptions(**fields)


def kv_transfer_config_dict(options: KVTransferOptions) -> dict[str, Any]:
    """The group as vLLM's kv_transfer_config (the keys --kv-transfer-config reads)."""
    value: dict[str, Any] = {key: getattr(options, name) for key, name in _KEYS.items()}
    extra = options.kv_connector_extra_config
    value["kv_connector_extra_config"] = json.loads(extra) if extra else {}
    return value

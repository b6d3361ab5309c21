"""The KV connectors' registry, and vLLM's `--kv-transfer-config` read into the options' group.

One row per connector a `kv_transfer.kv_connector` may name (vLLM's KVConnectorFactory names):
the worker's class for it ("module:Class", imported only by the worker) and what it moves. This
module imports no torch, so the engine core (the flag, the rules) and the ranks read the same
table. This build registers none yet, so every `--kv-transfer-config` is refused by the rules
(splitserve_runtime/engine_option_rules.py); a connector is its module plus one row here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from splitserve_contracts.engine_options_types import KVTransferOptions
from splitserve_contracts.json_object import parse_json_object


@dataclass(frozen=True, slots=True)
class KVConnector:
    """One registry row: vLLM's name, the worker's connector class and what `--help` says."""

    name: str
    connector_class: str
    help: str


CONNECTORS: tuple[KVConnector, ...] = ()
"""The registry (vLLM's names)."""

KV_CONNECTOR_NAMES = tuple(c.name for c in CONNECTORS)
"""The names `kv_transfer.kv_connector` accepts."""

_KEYS = {
    "kv_connector": "kv_connector",
    "kv_role": "kv_role",
    "kv_connector_extra_config": "kv_connector_extra_config",
    "engine_id": "kv_engine_id",
}
"""vLLM's KVTransferConfig keys this engine reads -> the KVTransferOptions field each fills."""


class InvalidKVTransferConfig(ValueError):
    """A --kv-transfer-config that is no JSON object of the keys this engine reads."""


def kv_connector_problem(name: str) -> str | None:
    """None when `name` is a registered connector, else what is wrong with it."""
    if name in KV_CONNECTOR_NAMES:
        return None
    if not KV_CONNECTOR_NAMES:
        return f"is {name!r}; this build has no KV connectors (choose one of: none)"
    return f"is {name!r}; choose one of {', '.join(KV_CONNECTOR_NAMES)}"


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

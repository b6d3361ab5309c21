"""The engine options as `splitserve core` flags, derived from the flag rows' `fills=` (the
inverse of core_svc/config.py's parse): an engine that splitserve/llm.py spawns gets its options
this way, so a new option's flag row is all it takes for it to travel."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

from core_svc.core_flags import CORE_FLAGS
from splitserve_contracts.engine_options_types import EngineOptions
from splitserve_runtime.flags import Flag
from splitserve_runtime.kv_connector_names import kv_transfer_config_dict

_GROUP_JSON: dict[str, Callable[[Any], dict[str, Any]]] = {"kv_transfer": kv_transfer_config_dict}
"""A group whose flag's JSON keys are not its fields' names, and how to spell it (any other
group's fields are the keys of its flag's JSON)."""


def option_flags(options: EngineOptions, given: Mapping[str, Any] | None = None) -> list[str]:
    """The flags that fill `options` where they differ from the contract's defaults; `given`
    ("group.field" or a group's name -> value; None leaves the flag out) spells a field as
    the caller has it instead (a JSON group as its dict, a value the core derives)."""
    given = given or {}
    defaults = EngineOptions()
    out: list[str] = []
    for row in CORE_FLAGS:
        if not row.fills:
            continue
        if row.fills in given:
            value = given[row.fills]
        else:
            value = _value(options, row.fills)
            if value == _value(defaults, row.fills):
                continue
        if value is not None:
            out += _spelled(row, value)
    return out


def _value(options: EngineOptions, path: str) -> Any:
    group, _, name = path.partition(".")
    record = getattr(options, group)
    return getattr(record, name) if name else record


def _spelled(row: Flag, value: Any) -> list[str]:
    name, action = row.names[0], row.settings.get("action")
    if action == "store_true":
        return [name] if value else []
    if action is argparse.BooleanOptionalAction:
        return [name if value else f"--no-{name[2:]}"]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        spell = _GROUP_JSON.get(row.fills, dataclasses.asdict)
        return [name, json.dumps(spell(value))]
    if isinstance(value, dict):
        return [name, json.dumps(value)]
    return [name, str(value)]

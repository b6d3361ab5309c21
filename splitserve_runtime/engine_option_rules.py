"""The rules of the engine's options (common.v1.EngineOptions), in one place: one row per field
that has one (ranges, and what depends on what); a string field with `(choices)` in the contract
accepts those and nothing else without a row here.

Both trust boundaries call `validate`: the engine core on the options its flags filled
(core_svc/config.py) and every worker rank on the options a LoadModel carries
(worker_svc/convert.py), so both refuse a value with the same words, naming the field
("lora.max_cpu_loras ..."). The records and their converters are generated from the contract
(splitserve_contracts/engine_options_*.py); `engine_options` builds one from flat field names.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

from splitserve_contracts.engine_options_types import (
    CHOICES,
    FIELD_GROUP,
    GROUPS,
    EngineOptions,
    LoRAOptions,
    SpeculativeOptions,
)
from splitserve_contracts.spec_decode import SpeculativeConfig
from splitserve_runtime.kv_connector_names import kv_connector_problem
from splitserve_runtime.model_spec import DTYPE_CHOICES
from splitserve_runtime.quantization_names import KV_CACHE_DTYPES, QUANTIZATION_CHOICES

MAX_LORAS = 256
"""Most adapter slots a rank accepts (vLLM's --max-loras has no cap; each slot is memory)."""
MAX_LORA_RANK = 512
"""vLLM's largest --max-lora-rank."""
MAX_COMPILE_TIMEOUT = 600.0
"""Longest a grammar may take to compile, in seconds."""


class InvalidEngineOptions(ValueError):
    """An option outside what the rules allow; the message names the field (`field`,
    "group.name") and says what to change."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field


Check = Callable[[Any, EngineOptions], str | None]
"""A rule: None when the value is fine in these options, else what is wrong with it."""


def _one_of(choices: tuple[str, ...], blank: bool = False) -> Check:
    def check(value: Any, options: EngineOptions) -> str | None:
        if value in choices or (blank and value == ""):
            return None
        return f"is {value!r}; choose one of {', '.join(choices)}"

    return check


def _at_least(low: int) -> Check:
    return lambda value, options: None if value >= low else f"must be >= {low}, got {value}"


def _async_scheduling(value: bool, options: EngineOptions) -> str | None:
    if value and options.parallel.pipeline_parallel_size > 1:
        return "needs parallel.pipeline_parallel_size 1 (every rank samples)"
    return None


def _max_loras(value: int, options: EngineOptions) -> str | None:
    return None if value <= MAX_LORAS else f"is {value}, more than {MAX_LORAS}"


def _max_lora_rank(value: int, options: EngineOptions) -> str | None:
    if options.lora.max_loras and not 1 <= value <= MAX_LORA_RANK:
        return f"must be in 1..{MAX_LORA_RANK} when lora.max_loras > 0, got {value}"
    return None


def _max_cpu_loras(value: int, options: EngineOptions) -> str | None:
    slots = options.lora.max_loras
    if slots and not slots <= value <= 64 * MAX_LORAS:
        return f"({value}) must be >= lora.max_loras ({slots})"
    return None


def _fraction(value: float, options: EngineOptions) -> str | None:
    return None if 0.0 < value <= 1.0 else f"must be in (0, 1], got {value}"


def _json_object(value: str, options: EngineOptions) -> str | None:
    try:
        parsed = json.loads(value) if value else {}
    except ValueError:
        parsed = None
    return None if isinstance(parsed, dict) else f"must be a JSON object, got {value!r}"


def _compile_timeout(value: float, options: EngineOptions) -> str | None:
    if 0 < value <= MAX_COMPILE_TIMEOUT:
        return None
    return f"must be a number of seconds in (0, {MAX_COMPILE_TIMEOUT:g}], got {value}"


RULES: dict[str, Check] = {
    "model.dtype": _one_of(DTYPE_CHOICES),
    "model.quantization": _one_of(QUANTIZATION_CHOICES, blank=True),
    "cache.block_size": _at_least(1),
    "cache.kv_cache_dtype": _one_of(KV_CACHE_DTYPES),
    "cache.gpu_memory_utilization": _fraction,
    "cache.kv_cache_memory_bytes": _at_least(0),
    "parallel.tensor_parallel_size": _at_least(1),
    "parallel.pipeline_parallel_size": _at_least(1),
    "scheduler.max_num_seqs": _at_least(1),
    "scheduler.max_num_batched_tokens": _at_least(1),
    "scheduler.async_scheduling": _async_scheduling,
    "scheduler.long_prefill_token_threshold": _at_least(0),
    "scheduler.prefill_token_budget": _at_least(0),
    "scheduler.adaptive_prefill_chunk": _at_least(0),
    "scheduler.max_num_queued_reqs": _at_least(0),
    "scheduler.max_num_queued_tokens": _at_least(0),
    "lora.max_loras": _max_loras,
    "lora.max_lora_rank": _max_lora_rank,
    "lora.max_cpu_loras": _max_cpu_loras,
    "structured_outputs.compile_timeout": _compile_timeout,
    "kv_transfer.kv_connector": lambda value, options: _kv_connector(value, options),
    "kv_transfer.kv_connector_extra_config": _json_object,
} | {path: _one_of(choices) for path, choices in CHOICES.items()}
"""One row per field with a rule, by "group.field"; the speculative group's rules are
SpeculativeConfig's (splitserve_contracts/spec_decode.py), shared with --speculative-config."""


def _kv_connector(value: str, options: EngineOptions) -> str | None:
    """A registered connector (or the one kv_connector_module_path defines). Any tensor and
    pipeline sizes: rank i moves its part of the KV with the other engine's rank i, and the
    handshake refuses peers whose layouts (sizes included) differ."""
    assert options.kv_transfer is not None
    return kv_connector_problem(value, options.kv_transfer.kv_connector_module_path)


def validate(options: EngineOptions) -> EngineOptions:
    """`options` when every field follows its rule; else InvalidEngineOptions for the first
    that does not (in contract order)."""
    for group in GROUPS:
        record = getattr(options, group)
        if record is None:
            continue
        for f in dataclasses.fields(record):
            rule = RULES.get(f"{group}.{f.name}")
            problem = None if rule is None else rule(getattr(record, f.name), options)
            if problem is not None:
                raise InvalidEngineOptions(f"{group}.{f.name}", problem)
    speculative_config(options.speculative)
    return options


def lora_slots(lora: LoRAOptions) -> int:
    """The engine's LoRA adapter slots (vLLM's --max-loras: distinct adapters one step may
    run); 0: LoRA is off. Every service reads the slot count through this."""
    return lora.max_loras


def lora_enabled(lora: LoRAOptions) -> bool:
    """Whether the engine serves LoRA adapters (--enable-lora: it has adapter slots); requests
    must not name an adapter otherwise."""
    return lora_slots(lora) > 0


def lora_group(num_slots: int, max_rank: int, num_cpu_adapters: int = 0) -> LoRAOptions:
    """The LoRA group of `num_slots` slots of adapters of rank <= `max_rank`, with
    `num_cpu_adapters` cached on the host (0: as many as the slots): for a rank built without
    the engine core (tests, benchmarks)."""
    return lora_options(True, LoRAOptions(num_slots, max_rank, num_cpu_adapters))


def lora_options(enabled: bool, lora: LoRAOptions) -> LoRAOptions:
    """The LoRA group as --enable-lora and its flags fill it: no slots and no host copies when
    LoRA is off, else max_cpu_loras unset (None or 0) as many as the slots."""
    if not enabled:
        return dataclasses.replace(lora, max_loras=0, max_cpu_loras=0)
    return dataclasses.replace(lora, max_cpu_loras=lora.max_cpu_loras or lora.max_loras)


def world_size(options: EngineOptions) -> int:
    """The engine's ranks: tensor_parallel_size x pipeline_parallel_size."""
    return options.parallel.tensor_parallel_size * options.parallel.pipeline_parallel_size


def speculative_config(spec: SpeculativeOptions | None) -> SpeculativeConfig | None:
    """The ranks' view of the speculative group (InvalidSpeculativeConfig, a ValueError that
    names the field, when it breaks its rules); None: no speculative decoding."""
    if spec is None:
        return None
    return SpeculativeConfig(
        spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
    )


def engine_options(values: Mapping[str, Any] | None = None, /, **more: Any) -> EngineOptions:
    """EngineOptions from flat field names (`block_size=32`: each name is in one group), or a
    whole group by its name (`speculative=...`: a record or anything with the group's fields
    as attributes or keys, or None; `model` names the field model.model); fields not named
    keep their defaults. Not validated."""
    named = {**(values or {}), **more}
    # `model` is model.model, not the group
    whole = {
        n: _group(GROUPS[n], v) for n, v in named.items() if n in GROUPS and n not in FIELD_GROUP
    }
    flat = {n: v for n, v in named.items() if n not in whole}
    groups = {group: GROUPS[group](**fields) for group, fields in _by_group(flat).items()}
    return EngineOptions(**(groups | whole))


def replace_options(options: EngineOptions, **fields: Any) -> EngineOptions:
    """`options` with the fields named (flat, as `engine_options` takes them) changed."""
    groups = {
        g: dataclasses.replace(getattr(options, g), **v) for g, v in _by_group(fields).items()
    }
    return dataclasses.replace(options, **groups)


def _by_group(fields: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Flat field names and values, grouped by the group each field is in; TypeError for a name
    that is no engine option."""
    by_group: dict[str, dict[str, Any]] = {}
    for name, value in fields.items():
        if name not in FIELD_GROUP:
            raise TypeError(f"{name!r} is not an engine option")
        by_group.setdefault(FIELD_GROUP[name], {})[name] = value
    return by_group


def _group(record: type, value: Any) -> Any:
    """`value` as the group's record: None, the record itself, or something that has its
    fields (another record, a mapping)."""
    if value is None or isinstance(value, record):
        return value
    names = [f.name for f in dataclasses.fields(record)]
    if isinstance(value, Mapping):
        return record(**{n: value[n] for n in names if n in value})
    return record(**{n: getattr(value, n) for n in names})

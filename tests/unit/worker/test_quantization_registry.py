"""The quantization registry: one row per `--quantization` name (splitserve_runtime/
quantization_names.py), its config class found by name (worker_svc/quantization/config.py), and
every list of names (the flag's choices, what a worker accepts, the config.json methods read)
derived from the rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core_svc.config import parse_config as parse_core
from splitserve_runtime.quantization_names import (
    ACCEPTED_FLAG_VALUES,
    CONFIG_FORMATS,
    FORMATS,
    QUANTIZATION_CHOICES,
    QuantizationFormat,
    canonical_quantization,
)
from worker_svc.model_loader.weights import quantize_config_json
from worker_svc.quantization.config import (
    PackedConfig,
    QuantizationConfig,
    get_quantization_config,
)
from worker_svc.quantization.fp8 import Fp8Config
from worker_svc.quantization.mxfp4 import Mxfp4Config
from worker_svc.quantization.online import OnlineConfig
from worker_svc.quantization.plan import resolve_quantization

ALIASES = {alias: row.name for row in FORMATS for alias in row.aliases}


@pytest.mark.parametrize("row", FORMATS, ids=lambda row: row.name)
def test_every_row_names_a_config_class_of_a_kind_the_loader_reads(
    row: QuantizationFormat,
) -> None:
    config = get_quantization_config(row.name)
    assert issubclass(config, QuantizationConfig)
    assert config.get_name() == row.name
    kinds = {"checkpoint": (Fp8Config, PackedConfig, Mxfp4Config), "float": (OnlineConfig,)}
    if row.reads in kinds:  # open_checkpoint serves these kinds; a gguf file has its reader
        assert issubclass(config, kinds[row.reads])


@pytest.mark.parametrize(("alias", "name"), ALIASES.items())
def test_an_alias_finds_its_formats_config(alias: str, name: str) -> None:
    assert get_quantization_config(alias) is get_quantization_config(name)
    assert canonical_quantization(alias) == name


def test_an_unknown_name_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError) as err:
        get_quantization_config("bitsandbytes")
    message = str(err.value)
    assert "unknown quantization method 'bitsandbytes'" in message
    assert all(row.name in message for row in FORMATS)


def test_the_name_lists_are_the_registrys() -> None:
    names = tuple(row.name for row in FORMATS)
    assert names == QUANTIZATION_CHOICES
    assert ("auto", *names, *ALIASES) == ACCEPTED_FLAG_VALUES
    assert tuple(row.name for row in FORMATS if row.reads == "checkpoint") == CONFIG_FORMATS


@pytest.mark.parametrize("value", ACCEPTED_FLAG_VALUES)
def test_the_core_flag_takes_every_registry_name(value: str) -> None:
    config = parse_core(["--worker-addrs", "h:1", "--quantization", value], {})
    assert config.options.model.quantization == canonical_quantization(value)
    assert config.options.model.quantization in ("", *QUANTIZATION_CHOICES)


def test_the_core_flag_refuses_a_name_without_a_row() -> None:
    with pytest.raises(SystemExit):
        parse_core(["--worker-addrs", "h:1", "--quantization", "bitsandbytes"], {})


@pytest.mark.parametrize(
    ("requested", "message"),
    [
        ("fp8", "needs an FP8 checkpoint; tiny is not quantized (online FP8 quantization is not "
         "supported: use --quantization int8, int4 or w8a8)"),
        ("gguf", "--quantization gguf needs a .gguf file; tiny is not one"),
        ("compressed-tensors", "reads compressed-tensors checkpoints; tiny is not one"),
        ("bitsandbytes", "unknown quantization method 'bitsandbytes'"),
    ],
)  # fmt: skip
def test_a_checkpoint_format_asked_of_a_float_checkpoint_is_refused(
    requested: str, message: str
) -> None:
    with pytest.raises(ValueError) as err:
        resolve_quantization(requested, None, "tiny")
    assert message in str(err.value)


@pytest.mark.parametrize("name", ["int8", "int4", "w8a8"])
def test_online_methods_serve_a_float_checkpoint(name: str) -> None:
    assert resolve_quantization(name, None, "tiny") == name


@pytest.mark.parametrize(
    ("requested", "read"), [("gptq", True), ("gptq_marlin", True), ("awq", False), ("", False)]
)
def test_a_formats_config_file_is_read_when_the_flag_names_it(
    tmp_path: Path, requested: str, read: bool
) -> None:
    """AutoGPTQ's quantize_config.json (GptqConfig.get_config_filenames, as vLLM's)."""
    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 32}))
    found = quantize_config_json(tmp_path, requested)
    assert found == ({"quant_method": "gptq", "bits": 4, "group_size": 32} if read else None)

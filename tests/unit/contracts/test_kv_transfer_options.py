"""--kv-transfer-config (vLLM's KVTransferConfig) into the engine options' kv_transfer group:
parsed like --speculative-config, checked by the rules (a registered connector, a kv_role of
the contract's choices), and carried to the ranks as it is."""

from __future__ import annotations

import json
import sys
import types

import pytest

from core_svc.config import parse_config
from core_svc.option_flags import option_flags
from splitserve_contracts import engine_options_convert as convert
from splitserve_contracts.engine_options_types import KVTransferOptions
from splitserve_runtime import kv_connector_names
from splitserve_runtime.engine_option_rules import InvalidEngineOptions, engine_options, validate
from splitserve_runtime.kv_connector_names import KVConnector

WORKERS = ["--worker-addrs", "h:1"]
CONFIG = {
    "kv_connector": "GrpcConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"backends": ["UCX"]},
    "engine_id": "e-1",
}


def refusal(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit):
        parse_config([*WORKERS, *argv], {})
    return capsys.readouterr().err


def test_no_flag_and_an_empty_object_mean_no_connector() -> None:
    assert parse_config(WORKERS, {}).options.kv_transfer is None
    assert parse_config([*WORKERS, "--kv-transfer-config", "{}"], {}).options.kv_transfer is None


def test_the_flag_fills_the_group_and_round_trips_to_flags() -> None:
    config = parse_config([*WORKERS, "--kv-transfer-config", json.dumps(CONFIG)], {})
    assert config.options.kv_transfer == KVTransferOptions(
        "GrpcConnector", "kv_both", '{"backends": ["UCX"]}', "e-1"
    )
    flags = option_flags(config.options)
    value = json.loads(flags[flags.index("--kv-transfer-config") + 1])
    assert value == CONFIG | {"kv_connector_module_path": ""}


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("{bad", "--kv-transfer-config: not JSON"),
        ("[1]", "--kv-transfer-config: expected a JSON object"),
        ('{"kv_buffer_size": 1}', "unknown keys ['kv_buffer_size']; this engine reads"),
        ('{"kv_role": 3}', "kv_role must be a string, got 3"),
        ('{"kv_connector_extra_config": [1]}', "kv_connector_extra_config must be a JSON object"),
    ],
)
def test_a_malformed_config_is_refused_naming_the_flag(
    value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert says in refusal(capsys, ["--kv-transfer-config", value])


def test_an_unregistered_connector_is_refused_naming_the_registered_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    said = refusal(capsys, ["--kv-transfer-config", json.dumps(CONFIG | {"kv_connector": "Nixl"})])
    assert (
        "--kv-transfer-config: kv_transfer.kv_connector is 'Nixl'; choose one of GrpcConnector"
        in said
    )


def test_a_connector_runs_on_an_engine_of_several_ranks() -> None:
    argv = ["--kv-transfer-config", json.dumps(CONFIG), "--tensor-parallel-size", "2"]
    config = parse_config(["--worker-addrs", "h:1,h:2", *argv], {})
    assert config.options.kv_transfer is not None
    assert config.options.parallel.tensor_parallel_size == 2


def test_a_module_path_names_a_connector_outside_the_build() -> None:
    row = KVConnector("Mine", "a:B", "c:D", "mine")
    module = types.ModuleType("my_connector_row")
    module.KV_CONNECTOR = row  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    try:
        assert kv_connector_names.find_connector("Mine", module.__name__) is row
        transfer = KVTransferOptions("Mine", "kv_both", kv_connector_module_path=module.__name__)
        validate(engine_options(kv_transfer=transfer))
        with pytest.raises(LookupError, match="defines no KV_CONNECTOR row named 'Other'"):
            kv_connector_names.find_connector("Other", module.__name__)
    finally:
        del sys.modules[module.__name__]
    with pytest.raises(LookupError, match="'no_such_module_x' cannot be imported"):
        kv_connector_names.find_connector("Mine", "no_such_module_x")


def test_a_role_outside_the_choices_is_refused_naming_the_field(
    capsys: pytest.CaptureFixture[str],
) -> None:
    said = refusal(capsys, ["--kv-transfer-config", json.dumps(CONFIG | {"kv_role": "kv_x"})])
    assert (
        "--kv-transfer-config: kv_transfer.kv_role is 'kv_x'; choose one of kv_producer, "
        "kv_consumer, kv_both" in said
    )
    unnamed = {"kv_connector": "GrpcConnector"}
    assert "kv_transfer.kv_role is ''" in refusal(
        capsys, ["--kv-transfer-config", json.dumps(unnamed)]
    )


def test_the_rules_name_the_field_and_another_connector_is_refused() -> None:
    options = engine_options(kv_transfer=KVTransferOptions("Other", "kv_both"))
    with pytest.raises(InvalidEngineOptions, match="kv_transfer.kv_connector is 'Other'; choose"):
        validate(options)
    bad_extra = engine_options(kv_transfer=KVTransferOptions("GrpcConnector", "kv_both", "[1]"))
    with pytest.raises(InvalidEngineOptions, match="kv_connector_extra_config must be a JSON"):
        validate(bad_extra)


def test_the_group_round_trips_through_its_message() -> None:
    options = engine_options(kv_transfer=KVTransferOptions("C", "kv_consumer", '{"a": 1}', "e"))
    msg = convert.to_proto(options)
    assert msg.HasField("kv_transfer")
    assert convert.from_proto(type(msg).FromString(msg.SerializeToString())) == options
    assert not convert.to_proto(engine_options()).HasField("kv_transfer")
    assert convert.from_proto(convert.to_proto(engine_options())).kv_transfer is None

"""generation_config.json sampling defaults: which fields, when they apply, when they do not."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from frontend_svc.config import parse_config
from frontend_svc.convert import generate_input_from_proto
from frontend_svc.inputs.generation_config import (
    SAMPLING_DEFAULT_FIELDS,
    eos_token_ids,
    generation_config_folder,
    log_sampling_defaults,
    sampling_defaults,
)
from frontend_svc.main import read_model_files
from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
from splitserve_contracts.sampling_types import SamplingParams

GENERATION = {
    "bos_token_id": 0,
    "eos_token_id": [1, 7],
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.9,
    "top_k": 20,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "max_new_tokens": 12,
}


def params(defaults: dict[str, object], **fields: object) -> SamplingParams:
    msg = gen_pb2.GenerateRequest(prompt="hi", sampling_params=types_pb2.SamplingParams(**fields))
    return generate_input_from_proto(msg, "r", defaults).params


def test_every_vllm_key_maps_to_a_sampling_field() -> None:
    defaults = sampling_defaults(GENERATION, "auto")
    assert defaults == {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "max_tokens": 12,
    }
    names = {f for f, _ in SAMPLING_DEFAULT_FIELDS.values()}
    assert names <= set(SamplingParams.__dataclass_fields__)
    assert sampling_defaults(GENERATION, "vllm") == {}
    assert eos_token_ids(GENERATION) == (1, 7) and eos_token_ids({"eos_token_id": 3}) == (3,)


def test_defaults_fill_only_unset_fields() -> None:
    defaults = sampling_defaults(GENERATION, "auto")
    unset = params(defaults)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.min_p) == (0.6, 0.9, 20, 0.05)
    assert (unset.repetition_penalty, unset.max_tokens) == (1.1, 12)
    # Presence: an explicit 0 temperature (greedy) and 1.0 top_p are the client's choice.
    chosen = params(defaults, temperature=0.0, top_p=1.0, max_tokens=3, top_k=-1, min_p=0.25)
    assert (chosen.temperature, chosen.top_p, chosen.max_tokens) == (0.0, 1.0, 3)
    assert (chosen.top_k, chosen.min_p) == (-1, 0.25)
    # top_k / min_p have no presence: 0 counts as unset, as in vLLM.
    assert params(defaults, top_k=0, min_p=0.0).top_k == 20
    assert params({}) == SamplingParams()


def test_generation_config_folder_modes(tmp_path: Path) -> None:
    assert generation_config_folder("auto", tmp_path) == tmp_path
    assert generation_config_folder("vllm", tmp_path) == tmp_path  # EOS ids still come from it
    assert generation_config_folder("auto", None) is None
    (tmp_path / "generation_config.json").write_text("{}")
    assert generation_config_folder(str(tmp_path), None) == tmp_path
    with pytest.raises(ValueError, match="no generation_config.json"):
        generation_config_folder(str(tmp_path / "missing"), None)


def model_with(folder: Path, tiny_model_dir: Path, generation: dict[str, object]) -> Path:
    shutil.copytree(tiny_model_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def test_frontend_reads_the_models_defaults(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = model_with(tmp_path / "m", tiny_model_dir, GENERATION)
    with caplog.at_level(logging.INFO):
        files = read_model_files(parse_config(["--model", str(model)], {}))
    assert files.sampling_defaults == sampling_defaults(GENERATION, "auto")
    assert files.eos_token_ids == (1, 7)
    assert "temperature=0.6" in caplog.text and "max_tokens=12" in caplog.text
    plain = read_model_files(
        parse_config(["--model", str(model), "--generation-config", "vllm"], {})
    )
    assert plain.sampling_defaults == {} and plain.eos_token_ids == (1, 7)


def test_invalid_defaults_are_refused_at_start(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = model_with(tmp_path / "m", tiny_model_dir, {"temperature": -1.0})
    with pytest.raises(ValueError, match="generation config's sampling defaults are invalid"):
        read_model_files(parse_config(["--model", str(model)], {}))


def test_log_names_vllm_defaults_when_none_apply(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        log_sampling_defaults({}, "auto")
    assert "sets no sampling defaults" in caplog.text

"""What a worker refuses to serve, each with a one-line message naming the offending value:
quantized checkpoints, rope types and activations our model code does not implement."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.checkpoints import CheckpointCache, hf_config
from worker_svc.layers.rope_config import SUPPORTED_ROPE_TYPES
from worker_svc.model_loader.model_load import LoadModelConfig
from worker_svc.worker import Worker


def edited_checkpoint(source: Path, folder: Path, **changes: Any) -> Path:
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def refusal(path: Path) -> str:
    with pytest.raises(ValueError) as err:
        Worker("cpu").load_model(LoadModelConfig.of(str(path)))
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("method", ["awq", "gptq", "bitsandbytes", "compressed-tensors"])
def test_quantized_checkpoints_are_refused_naming_the_method(
    worker_checkpoints: CheckpointCache, tmp_path: Path, method: str
) -> None:
    """A config-only quantization flag must not be served as if its weights were floats."""
    quantization = {"quant_method": method, "bits": 4, "activation_scheme": "dynamic"}
    path = edited_checkpoint(
        worker_checkpoints.get("llama"), tmp_path / "q", quantization_config=quantization
    )
    message = refusal(path)
    assert f"quantization method {method!r}" in message and "not supported" in message


@pytest.mark.parametrize(
    ("quantization", "expected"),
    [
        ({"weight_block_size": [128]}, "weight_block_size must be two positive sizes"),
        ({"fmt": "e5m2"}, "fp8 format 'e5m2' is not supported"),
    ],
)
def test_fp8_layouts_we_cannot_read_are_refused(
    worker_checkpoints: CheckpointCache,
    tmp_path: Path,
    quantization: dict[str, Any],
    expected: str,
) -> None:
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", **quantization}
    path = edited_checkpoint(
        worker_checkpoints.get("llama"), tmp_path / "f", quantization_config=config
    )
    assert expected in refusal(path)


@pytest.mark.parametrize(
    "rope",
    [{"rope_type": "proportional", "factor": 2.0}],
)
def test_unknown_rope_types_are_refused_with_the_supported_list(
    worker_checkpoints: CheckpointCache, tmp_path: Path, rope: dict[str, Any]
) -> None:
    path = edited_checkpoint(
        worker_checkpoints.get("llama"),
        tmp_path / "r",
        rope_parameters={**rope, "rope_theta": 10000.0},
    )
    message = refusal(path)
    assert f"rope type {rope['rope_type']!r} is not supported" in message
    assert all(t in message for t in SUPPORTED_ROPE_TYPES)


def test_unknown_activation_is_refused(worker_checkpoints: CheckpointCache, tmp_path: Path) -> None:
    path = edited_checkpoint(worker_checkpoints.get("llama"), tmp_path / "a", hidden_act="gelu")
    message = refusal(path)
    assert "hidden_act 'gelu' is not supported for LlamaForCausalLM" in message
    assert message.endswith("supported activations: silu")
    tanh = edited_checkpoint(
        worker_checkpoints.get("llama"), tmp_path / "t", hidden_act="gelu_pytorch_tanh"
    )
    assert "hidden_act 'gelu_pytorch_tanh' is not supported for LlamaForCausalLM" in refusal(tanh)


def test_an_architecture_transformers_does_not_know_is_refused_by_name(
    worker_checkpoints: CheckpointCache, tmp_path: Path
) -> None:
    """Our refusal comes before transformers tries to parse a model type it has never seen."""
    path = edited_checkpoint(
        worker_checkpoints.get("llama"),
        tmp_path / "new",
        architectures=["BrandNewForCausalLM"],
        model_type="brand_new",
    )
    message = refusal(path)
    assert message.startswith("architecture 'BrandNewForCausalLM' is not supported")
    assert "LlamaForCausalLM" in message


def test_models_with_windows_or_soft_caps_leave_the_cpu_backend_for_torch() -> None:
    from dataclasses import replace

    from worker_svc.model_loader.model_build import backend_for_model
    from worker_svc.models.gemma2 import GemmaConfig
    from worker_svc.models.model_config import ModelConfig

    plain = ModelConfig.from_hf_config(hf_config("llama", architectures=["LlamaForCausalLM"]))
    windowed = replace(plain, sliding_window=6)
    gemma = GemmaConfig.read(hf_config("gemma2", architectures=["Gemma2ForCausalLM"]))
    assert backend_for_model("cpu", "auto", plain) == "cpu"
    assert backend_for_model("cpu", "auto", windowed) == "torch"
    capped = replace(gemma, sliding_window=None, layer_types=())
    assert capped.attn_logit_softcapping == 3.0
    assert backend_for_model("cpu", "auto", capped) == "torch"
    assert backend_for_model("triton", "triton", windowed) == "triton"
    with pytest.raises(ValueError, match="attention-backend torch"):
        backend_for_model("cpu", "cpu", windowed)

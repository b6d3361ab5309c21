"""Models behind interfaces (issue 23): the registry imports a family only when it is asked for;
every architecture builds into a `CausalLM` and only LLaVA supports images; each linear layer's
method is chosen by its module path when the model is built; ops take the CPU kernels'
implementation when built with them (the worker: on the cpu attention backend) and the torch
one otherwise, subclasses included."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.fixtures.checkpoints import CheckpointCache, hf_config
from tests.fixtures.hybrid_checkpoints import hybrid_config
from tests.fixtures.qwen3_next_checkpoint import QWEN3_NEXT
from worker_svc.attention.selector import backend_class
from worker_svc.distributed import ParallelState
from worker_svc.kernels.cpu_kernels import CpuKernels
from worker_svc.layers.custom_op import CustomOp
from worker_svc.layers.linear import (
    LinearBase,
    LinearMethodBase,
    UnquantizedLinearMethod,
    linear_layers,
)
from worker_svc.model_loader.model_load import LoadModelConfig
from worker_svc.models.decoder import BuildContext
from worker_svc.models.interfaces import CausalLM, supports_images
from worker_svc.models.registry import SUPPORTED_ARCHITECTURES, model_class
from worker_svc.worker import Worker

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[3]
FAMILY_OF = {
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Glm4ForCausalLM": "glm4",
    "GptOssForCausalLM": "gpt_oss",
    "GraniteForCausalLM": "granite",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "Olmo2ForCausalLM": "olmo2",
    "Phi3ForCausalLM": "phi3",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "SmolLM3ForCausalLM": "smollm3",
}


class RecordingMethods:
    """A LinearMethods that hands out unquantized methods and records who asked."""

    def __init__(self) -> None:
        self.prefixes: list[str] = []

    def method_for(self, layer: LinearBase, prefix: str) -> LinearMethodBase:
        self.prefixes.append(prefix)
        return UnquantizedLinearMethod()

    def vocab_method(self, prefix: str) -> LinearMethodBase | None:
        return None


IMAGE_ARCHITECTURES = ("LlavaForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")


def hybrid_hf_config(architecture: str) -> Any:
    """The hybrid families' configs (their fixtures' own modules)."""
    import transformers

    if architecture == "GraniteMoeHybridForCausalLM":
        return hybrid_config(architectures=[architecture])
    return transformers.Qwen3NextConfig(**QWEN3_NEXT, architectures=[architecture])


HYBRID_ARCHITECTURES = ("GraniteMoeHybridForCausalLM", "Qwen3NextForCausalLM")


def architecture_config(architecture: str, image_dirs: dict[str, Path]) -> Any:
    if architecture in HYBRID_ARCHITECTURES:
        return hybrid_hf_config(architecture)
    if architecture in image_dirs:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(image_dirs[architecture]), local_files_only=True)
    return hf_config(FAMILY_OF[architecture], architectures=[architecture])


def build(architecture: str, image_dirs: dict[str, Path], **changes: Any) -> nn.Module:
    cls = model_class(architecture)
    config = cls.read_config(architecture_config(architecture, image_dirs))
    backend = backend_class("torch")(
        config.num_heads, config.num_kv_heads, config.head_dim, dtype=torch.float32, device=CPU
    )
    context = BuildContext(config, ParallelState(), backend, torch.float32, CPU, max_positions=64)
    model = context.create(cls, **changes)
    assert isinstance(model, nn.Module)
    return model


def test_the_registry_imports_a_family_only_when_asked() -> None:
    code = (
        "import sys\n"
        "from worker_svc.models.registry import model_class\n"
        "loaded = lambda: {m for m in sys.modules if m.startswith('worker_svc.models.')}\n"
        "print(sorted(loaded()))\n"
        "model_class('GraniteForCausalLM')\n"
        "print(sorted(loaded()))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    before, after = done.stdout.splitlines()
    assert "worker_svc.models.llama" not in before and "worker_svc.models.llava" not in before
    assert "worker_svc.models.granite" in after and "worker_svc.models.gemma2" not in after


@pytest.mark.parametrize("architecture", SUPPORTED_ARCHITECTURES)
def test_every_architecture_is_a_causal_lm_whose_linears_are_chosen_by_path(
    architecture: str, llava_model_dir: Path, qwen2_5_vl_model_dir: Path
) -> None:
    methods = RecordingMethods()
    image_dirs = dict(
        zip(IMAGE_ARCHITECTURES, (llava_model_dir, qwen2_5_vl_model_dir), strict=True)
    )
    model = build(architecture, image_dirs, linear_methods=methods)
    assert isinstance(model, CausalLM)
    assert supports_images(model) == (architecture in IMAGE_ARCHITECTURES)
    paths = [path for path, _ in linear_layers(model)]
    assert paths and sorted(methods.prefixes) == sorted(paths)


def test_ops_take_the_cpu_kernels_only_when_built_with_them() -> None:
    kernels = CpuKernels.load()
    assert kernels is not None, "the CPU kernels did not build (is g++ installed?)"
    with_kernels = build("GraniteForCausalLM", {}, cpu_kernels=kernels)
    ops = [m for m in with_kernels.modules() if isinstance(m, CustomOp) and m.has_cpu_kernels]
    assert {type(m).__name__ for m in ops} == {"RMSNorm", "RotaryEmbedding", "SiluAndMul"}
    assert {m.implementation for m in ops} == {"cpu_kernels"}
    plain = build("GraniteForCausalLM", {})
    assert {m.implementation for m in plain.modules() if isinstance(m, CustomOp)} == {"native"}


@pytest.mark.parametrize(
    ("backend", "implementation"), [("cpu", "cpu_kernels"), ("torch", "native")]
)
def test_the_worker_builds_with_the_kernels_on_the_cpu_backend(
    worker_checkpoints: CheckpointCache, backend: str, implementation: str
) -> None:
    worker = Worker("cpu")
    try:
        worker.load_model(
            LoadModelConfig.of(str(worker_checkpoints.get("qwen3")), attention_backend=backend)
        )
        assert worker.runner is not None
        model = worker.runner.model
        ops = [m for m in model.modules() if isinstance(m, CustomOp) and m.has_cpu_kernels]
        assert ops and {m.implementation for m in ops} == {implementation}
        assert hasattr(worker.runner.backend, "kernels") == (backend == "cpu")
    finally:
        worker.shutdown()


@pytest.mark.parametrize("family", ["gemma2", "granite", "llava"])
def test_a_loaded_rank_checks_a_new_model_as_its_family_reads_it(
    worker_checkpoints: CheckpointCache, llava_model_dir: Path, family: str
) -> None:
    """Before a loaded rank drops its model for a restarted core's LoadModel it checks the new
    one: a LLaVA checkpoint (whose config.json nests its language model) must pass."""
    from worker_svc.ownership import check_model_loadable

    path = llava_model_dir if family == "llava" else worker_checkpoints.get(family)
    check_model_loadable(str(path))


def test_a_llava_checkpoint_without_a_vision_tensor_is_refused(
    llava_model_dir: Path, tmp_path: Path
) -> None:
    """LLaVA holds its language model; both halves check that every parameter was loaded."""
    import shutil

    from safetensors.torch import load_file, save_file

    for item in llava_model_dir.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, tmp_path / item.name)
    (weights,) = llava_model_dir.glob("*.safetensors")
    tensors = load_file(str(weights))
    (dropped,) = [n for n in tensors if "multi_modal_projector.linear_2.bias" in n]
    del tensors[dropped]
    save_file(tensors, str(tmp_path / weights.name), metadata={"format": "pt"})
    worker = Worker("cpu")
    with pytest.raises(
        ValueError, match=r"lacks tensors for: multi_modal_projector\.linear_2\.bias"
    ):
        worker.load_model(LoadModelConfig.of(str(tmp_path)))

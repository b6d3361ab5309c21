"""GraniteMoeHybridForCausalLM on its own (no runner): the tiny checkpoints loaded through the
model's weight names, run over paged KV (attention layers) and state slots (Mamba2 layers) in
chunked steps, two requests sharing steps; every position's float32 logits against
transformers' forward over the whole sequence."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fixtures.hybrid_checkpoints import make_hybrid_checkpoint
from tests.fixtures.hybrid_engine import HybridEngine, max_plan_diff, sequence
from worker_svc.attention.selector import backend_class
from worker_svc.distributed import ParallelState
from worker_svc.layers.linear import (
    LinearBase,
    LinearMethodBase,
    UnquantizedLinearMethod,
    linear_layers,
)
from worker_svc.models.decoder import BuildContext
from worker_svc.models.granitemoehybrid import GraniteMoeHybridForCausalLM
from worker_svc.models.model_config import read_hf_config
from worker_svc.models.registry import model_class

CPU = torch.device("cpu")
TOLERANCE = 1e-4
BLOCKS_PER_REQUEST = 32
VARIANTS = ["granite_hybrid", "granite_hybrid_g1"]


@pytest.fixture(scope="module", params=VARIANTS)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hybrid_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(checkpoint), dtype=torch.float32
    ).eval()


def Engine(checkpoint: Path) -> HybridEngine:  # noqa: N802 (reads as the class it makes)
    return HybridEngine(GraniteMoeHybridForCausalLM, checkpoint, BLOCKS_PER_REQUEST)


def test_registry_serves_it() -> None:
    assert model_class("GraniteMoeHybridForCausalLM") is GraniteMoeHybridForCausalLM


class RecordingMethods:
    """Unquantized methods, recording the module path each linear layer asked with."""

    def __init__(self) -> None:
        self.prefixes: list[str] = []

    def method_for(self, layer: LinearBase, prefix: str) -> LinearMethodBase:
        self.prefixes.append(prefix)
        return UnquantizedLinearMethod()

    def vocab_method(self, prefix: str) -> LinearMethodBase | None:
        return None


def test_linears_are_chosen_by_their_module_paths(checkpoint: Path) -> None:
    config = GraniteMoeHybridForCausalLM.read_config(read_hf_config(checkpoint))
    backend = backend_class("torch")(
        config.num_heads, config.num_kv_heads, config.head_dim, dtype=torch.float32, device=CPU
    )
    methods = RecordingMethods()
    build = BuildContext(
        config, ParallelState(), backend, torch.float32, CPU, 64, linear_methods=methods
    )
    model = build.create(GraniteMoeHybridForCausalLM)
    paths = sorted(path for path, _ in linear_layers(model))
    assert paths and sorted(methods.prefixes) == paths
    assert any(path.endswith("mamba.in_proj") for path in paths)


def test_state_specs_follow_the_layer_types(checkpoint: Path) -> None:
    hf = read_hf_config(checkpoint)
    specs = Engine(checkpoint).model.state_specs
    assert [spec is None for spec in specs] == [t == "full_attention" for t in hf.layer_types]
    conv_dim = 64 + 2 * hf.mamba_n_groups * 16
    assert {spec.shapes for spec in specs if spec} == {((conv_dim, 3), (4, 16, 16))}


def test_chunked_steps_match_transformers(checkpoint: Path, reference: Any) -> None:
    """Request 0: chunks 19, 1, 13 then decodes; request 1 prefills beside them."""
    engine = Engine(checkpoint)
    first, second = sequence(37, seed=1), sequence(30, seed=2)
    plan = [
        [(0, first[:19], 0)],
        [(0, first[19:20], 19), (1, second[:21], 0)],
        [(1, second[21:25], 21), (0, first[20:33], 20)],
        [(0, first[33:34], 33), (1, second[25:26], 25)],
        [(1, second[26:30], 26), (0, first[34:35], 34)],
        [(0, first[35:37], 35)],
    ]
    diffs = max_plan_diff(engine, reference, {0: first, 1: second}, plan)
    assert max(diffs.values()) < TOLERANCE, diffs


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("position_embedding_type", "alibi", "position_embedding_type"),
        ("layer_types", ["linear_attention", "moe", "linear_attention", "full_attention"], "moe"),
        ("hidden_act", "gelu", "hidden_act"),
    ],
)
def test_refuses_unimplemented_features(
    checkpoint: Path, field: str, value: Any, match: str
) -> None:
    hf = read_hf_config(checkpoint)
    setattr(hf, field, value)
    with pytest.raises(ValueError, match=match):
        GraniteMoeHybridForCausalLM.read_config(hf)

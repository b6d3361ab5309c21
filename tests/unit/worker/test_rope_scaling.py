"""Rope scaling (yarn, dynamic NTK, longrope, partial rotary) against transformers' own
frequency functions, and the context each scaling allows."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.fixtures.checkpoints import hf_config
from worker_svc.layers.rotary import RotaryEmbedding, attention_scaling, inverse_frequencies
from worker_svc.models.model_config import ModelConfig

CPU = torch.device("cpu")
HEAD_DIM = 16
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
YARN_MSCALE = {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16.0}
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0}
LONGROPE = {
    "rope_type": "longrope",
    "original_max_position_embeddings": 128,
    "short_factor": [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)],
    "long_factor": [2.0 + 0.5 * i for i in range(HEAD_DIM // 2)],
}


def llama_config(rope: dict[str, Any], **overrides: Any) -> Any:
    return hf_config(
        "llama",
        architectures=["LlamaForCausalLM"],
        rope_parameters={**rope, "rope_theta": 10000.0},
        **overrides,
    )


def transformers_rope(hf: Any, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = hf.rope_parameters["rope_type"]
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, CPU, seq_len=seq_len)
    return inv_freq, float(scaling)


@pytest.mark.parametrize("rope", [YARN, YARN_MSCALE], ids=["yarn", "yarn-mscale"])
def test_yarn_matches_transformers(rope: dict[str, Any]) -> None:
    hf = llama_config(rope)
    ours = ModelConfig.from_hf_config(hf).rope
    theirs, scaling = transformers_rope(hf)
    assert torch.equal(inverse_frequencies(HEAD_DIM, ours), theirs)
    assert attention_scaling(ours) == pytest.approx(scaling, rel=1e-12)
    assert attention_scaling(ours) != 1.0


@pytest.mark.parametrize("context_len", [256, 512, 1024])
def test_dynamic_ntk_matches_transformers_at_the_served_length(context_len: int) -> None:
    """Up to max_position_embeddings (512) nothing is scaled, beyond it the base grows."""
    hf = llama_config(DYNAMIC)
    rope = ModelConfig.from_hf_config(hf).rope
    theirs, _ = transformers_rope(hf, seq_len=context_len)
    assert torch.allclose(inverse_frequencies(HEAD_DIM, rope, context_len), theirs, rtol=1e-6)
    plain = inverse_frequencies(
        HEAD_DIM, ModelConfig.from_hf_config(llama_config({"rope_type": "default"})).rope
    )
    assert torch.equal(inverse_frequencies(HEAD_DIM, rope, context_len), plain) == (
        context_len <= 512
    )


@pytest.mark.parametrize("context_len", [128, 512])
def test_longrope_picks_short_or_long_factors_by_the_served_length(context_len: int) -> None:
    hf = llama_config(LONGROPE)
    rope = ModelConfig.from_hf_config(hf).rope
    theirs, scaling = transformers_rope(hf, seq_len=context_len)
    assert torch.equal(inverse_frequencies(HEAD_DIM, rope, context_len), theirs)
    assert attention_scaling(rope) == pytest.approx(scaling, rel=1e-12)
    assert scaling > 1.0  # factor = 512 / 128


def test_partial_rotary_rotates_only_the_first_part_of_each_head() -> None:
    hf = llama_config({"rope_type": "default", "partial_rotary_factor": 0.5})
    rope = ModelConfig.from_hf_config(hf).rope
    rotary = RotaryEmbedding(HEAD_DIM, 64, rope, dtype=torch.float32, device=CPU)
    assert rotary.rotary_dim == 8
    x = torch.randn(5, 3, HEAD_DIM)
    cos, sin = rotary.cos_sin(torch.arange(5) + 7)
    out = rotary.rotate(x, cos, sin)
    assert torch.equal(out[..., 8:], x[..., 8:])
    assert not torch.allclose(out[..., :8], x[..., :8])
    assert torch.allclose(out[..., :8].norm(dim=-1), x[..., :8].norm(dim=-1), atol=1e-5)


def test_scaled_ropes_extend_the_context_as_vllm_derives_it() -> None:
    assert ModelConfig.from_hf_config(llama_config(DYNAMIC)).max_context_len == 1024
    assert ModelConfig.from_hf_config(llama_config(YARN)).max_context_len == 512
    assert ModelConfig.from_hf_config(llama_config(LONGROPE)).max_context_len == 512
    big_yarn = {**YARN, "factor": 8.0}
    assert ModelConfig.from_hf_config(llama_config(big_yarn)).max_context_len == 1024

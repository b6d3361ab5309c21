"""Qwen2.5-VL's config.json as the worker reads it: a released checkpoint's transformers-4 keys
(`rope_scaling` {"type": "mrope"}, tie_word_embeddings on the outer config) and the refusals."""

from __future__ import annotations

from typing import Any

import pytest
import transformers

from worker_svc.models.registry import read_model_config

VISION = {
    "depth": 2,
    "hidden_act": "silu",
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_heads": 4,
    "out_hidden_size": 64,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "window_size": 112,
    "fullatt_block_indexes": [1],
    "temporal_patch_size": 2,
}


def released_style(**changes: Any) -> Any:
    """A config shaped like Qwen2.5-VL-3B-Instruct's config.json (tiny sizes)."""
    fields: dict[str, Any] = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "vocab_size": 300,
        "tie_word_embeddings": True,
        "image_token_id": 290,
        "vision_config": VISION,
        **changes,
    }
    return transformers.Qwen2_5_VLConfig(**fields)


def test_a_released_config_reads_its_mrope_sections_and_tied_embeddings() -> None:
    config: Any = read_model_config(released_style())
    assert config.rope.mrope_section == (2, 3, 3) and config.rope.rope_type == "default"
    assert config.rope.theta == 1000000.0
    assert config.tie_word_embeddings
    assert config.vision.fullatt_block_indexes == (1,) and config.image_token_id == 290
    assert not read_model_config(released_style(tie_word_embeddings=False)).tie_word_embeddings


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"rope_scaling": {"type": "default"}}, "mrope_section"),
        ({"vision_config": {**VISION, "out_hidden_size": 48}}, "out_hidden_size"),
        ({"vision_config": {**VISION, "hidden_act": "relu"}}, "hidden_act"),
    ],
)
def test_what_is_not_implemented_is_refused_by_name(changes: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        read_model_config(released_style(**changes))

"""The model as the engine's model options serve it (model_build.served_model): max_model_len
and vLLM's disable_sliding_window, which makes every layer attend fully and caps the model's
length to its window (vLLM's _get_and_verify_max_len), and is ignored for a model without one."""

from __future__ import annotations

from dataclasses import replace

import pytest

from splitserve_contracts.engine_options_types import ModelOptions
from tests.fixtures.checkpoints import hf_config
from worker_svc.model_loader.model_build import backend_for_model, served_model
from worker_svc.models.gemma2 import GemmaConfig
from worker_svc.models.model_config import ModelConfig

DISABLED = ModelOptions(disable_sliding_window=True)


def mistral(window: int | None = 6) -> ModelConfig:
    hf = hf_config("mistral_window", architectures=["MistralForCausalLM"], sliding_window=window)
    return ModelConfig.from_hf_config(hf)


def test_max_model_len_is_the_options_or_the_models_limit() -> None:
    model = mistral()
    assert served_model(model, ModelOptions()) == (model, 512)
    assert served_model(model, ModelOptions(max_model_len=100)) == (model, 100)
    with pytest.raises(ValueError, match="max_model_len 513 exceeds the model's limit of 512$"):
        served_model(model, ModelOptions(max_model_len=513))


def test_disabling_the_window_attends_fully_and_caps_the_length_to_it() -> None:
    model = mistral()
    assert model.kv_sliding_window == 6 and backend_for_model("cpu", "auto", model) == "torch"
    served, max_model_len = served_model(model, DISABLED)
    assert max_model_len == 6 and served == replace(model, sliding_window=None)
    assert all(served.layer_window(i) is None for i in range(served.num_layers))
    assert served.kv_sliding_window is None  # the rank reports 0: the core keeps every block
    assert backend_for_model("cpu", "cpu", served) == "cpu"  # no window left to refuse it for
    assert served_model(model, replace(DISABLED, max_model_len=4))[1] == 4
    with pytest.raises(ValueError, match=r"max_model_len 7 exceeds the model's limit of 6 \(its"):
        served_model(model, replace(DISABLED, max_model_len=7))


def test_a_window_wider_than_the_model_caps_nothing() -> None:
    served, max_model_len = served_model(mistral(window=4096), DISABLED)
    assert max_model_len == 512 and served.sliding_window is None


def test_a_model_without_a_window_ignores_the_option() -> None:
    plain = mistral(window=None)
    assert served_model(plain, DISABLED) == (plain, 512)
    qwen2 = ModelConfig.from_hf_config(hf_config("qwen2", architectures=["Qwen2ForCausalLM"]))
    assert qwen2.sliding_window is None  # use_sliding_window: false
    assert served_model(qwen2, DISABLED) == (qwen2, 512)


def test_gemma3_local_layers_keep_their_kind_without_a_window() -> None:
    hf = hf_config("gemma3", architectures=["Gemma3ForCausalLM"])
    gemma = GemmaConfig.read(hf, qk_norm=True, attn_logit_softcapping=None)
    served, max_model_len = served_model(gemma, DISABLED)
    assert max_model_len == 6 and isinstance(served, GemmaConfig)
    assert [served.is_sliding_layer(i) for i in range(6)] == [True] * 5 + [False]
    assert all(served.layer_window(i) is None for i in range(6))
    assert served.local_rope == gemma.local_rope is not None

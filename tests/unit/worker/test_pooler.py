"""The worker's pooler: a prompt pooled in chunks equals the prompt pooled at once (LAST, MEAN,
CLS), a recompute starts afresh, and the sentence-transformers configuration decides the
pooling (both its current and its legacy files); what we cannot reproduce is refused."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from splitserve_contracts.output_types import PoolerConfig
from worker_svc.model_loader.pooling_config import is_pooling_runner, read_pooler_config
from worker_svc.runner.pooler import Pooler
from worker_svc.runner.step_inputs import StepInputs

HIDDEN = 8


def step_inputs(chunks: list[tuple[int, int, int, bool]]) -> StepInputs:
    """One step of (handle, first position, num tokens, completes its prompt) per request."""
    counts = np.array([c[2] for c in chunks])
    qsl = np.concatenate([[0], np.cumsum(counts)])
    positions = np.concatenate([np.arange(s, s + n) for _, s, n, _ in chunks])
    done = np.array([i for i, c in enumerate(chunks) if c[3]], dtype=np.int64)
    empty = np.zeros(0, np.int64)
    return StepInputs(
        rows=np.arange(len(chunks)),
        req_handles=np.array([c[0] for c in chunks]),
        input_ids=np.zeros(int(qsl[-1]), np.int64),
        positions=positions,
        slot_mapping=empty,
        query_start_loc=qsl,
        seq_lens=np.array([s + n for _, s, n, _ in chunks]),
        block_tables=empty[None, :],
        logits_indices=qsl[1:][done] - 1,
        sampling_reqs=done,
    )


def expected(states: torch.Tensor, pooling_type: str, normalize: bool) -> np.ndarray:
    vector = {"LAST": states[-1], "CLS": states[0], "MEAN": states.mean(0)}[pooling_type]
    if normalize:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    return vector.numpy()


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
@pytest.mark.parametrize("normalize", [True, False])
def test_chunked_prompt_pools_as_the_whole_prompt(pooling_type: str, normalize: bool) -> None:
    torch.manual_seed(0)
    a, b = torch.randn(11, HIDDEN), torch.randn(3, HIDDEN)
    pooler = Pooler(PoolerConfig(pooling_type, normalize, HIDDEN))
    # step 1: a[0:4] and all of b; step 2: a[4:9]; step 3: a[9:11]
    out1, failed = pooler.pool(
        torch.cat([a[:4], b]), step_inputs([(1, 0, 4, False), (2, 0, 3, True)])
    )
    out2, _ = pooler.pool(a[4:9], step_inputs([(1, 4, 5, False)]))
    out3, _ = pooler.pool(a[9:], step_inputs([(1, 9, 2, True)]))
    assert not failed and not out2 and [o.req_handle for o in out1 + out3] == [2, 1]
    got_b = np.frombuffer(out1[0].data, "<f4")
    got_a = np.frombuffer(out3[0].data, "<f4")
    np.testing.assert_allclose(got_b, expected(b, pooling_type, normalize), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_a, expected(a, pooling_type, normalize), rtol=1e-5, atol=1e-6)


def test_a_recompute_starts_afresh_and_a_lost_prefix_fails_the_request() -> None:
    torch.manual_seed(1)
    a = torch.randn(6, HIDDEN)
    pooler = Pooler(PoolerConfig("MEAN", False, HIDDEN))
    pooler.pool(torch.randn(3, HIDDEN), step_inputs([(1, 0, 3, False)]))  # then preempted
    pooler.pool(a[:3], step_inputs([(1, 0, 3, False)]))
    out, _ = pooler.pool(a[3:], step_inputs([(1, 3, 3, True)]))
    np.testing.assert_allclose(np.frombuffer(out[0].data, "<f4"), a.mean(0).numpy(), rtol=1e-5)
    _, failed = pooler.pool(a[3:], step_inputs([(5, 3, 3, True)]))
    assert list(failed) == [5]


@pytest.mark.parametrize("pooling_type", ["CLS", "LAST"])
def test_an_encoder_only_pooler_refuses_part_of_a_prompt(pooling_type: str) -> None:
    """Bidirectional attention needs the whole prompt in one step: a chunk that starts or
    stops part-way fails its request, the whole prompts beside it are pooled."""
    config = PoolerConfig(pooling_type, False, HIDDEN, is_encoder_only=True)
    hidden = torch.randn(9, HIDDEN)
    chunks = [(1, 0, 3, True), (2, 0, 4, False), (3, 4, 2, True)]
    out, failed = Pooler(config).pool(hidden, step_inputs(chunks))
    assert [o.req_handle for o in out] == [1]
    assert sorted(failed) == [2, 3] and "whole, in one step" in failed[2]


def write_st(folder: Path, modules: list[str], pooling: dict[str, object]) -> Path:
    entries = [
        {"idx": i, "name": str(i), "path": "" if i == 0 else f"{i}_{kind}", "type": f"x.{kind}"}
        for i, kind in enumerate(modules)
    ]
    (folder / "modules.json").write_text(json.dumps(entries))
    (folder / "1_Pooling").mkdir(parents=True, exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return folder


HF = SimpleNamespace()


@pytest.mark.parametrize(
    ("modules", "pooling", "want"),
    [
        (["Transformer", "Pooling", "Normalize"], {"pooling_mode": "mean"}, ("MEAN", True)),
        (["Transformer", "Pooling"], {"pooling_mode": "lasttoken"}, ("LAST", False)),
        (["Transformer", "Pooling"], {"pooling_mode_cls_token": True}, ("CLS", False)),
    ],
)
def test_sentence_transformers_files_decide_the_pooling(
    tmp_path: Path, modules: list[str], pooling: dict[str, object], want: tuple[str, bool]
) -> None:
    config = read_pooler_config(write_st(tmp_path, modules, pooling), HF, HIDDEN)
    assert (config.pooling_type, config.normalize) == want
    assert read_pooler_config(None, HF, HIDDEN).pooling_type == "LAST"  # vLLM's decoder default


@pytest.mark.parametrize(
    ("modules", "pooling", "message"),
    [
        (["Transformer", "Pooling", "Dense"], {"pooling_mode": "mean"}, "pipeline"),
        (["Transformer", "Pooling"], {"pooling_mode": "max"}, "pooling mode"),
        (["Transformer", "Pooling"], {"pooling_mode": "mean", "include_prompt": False}, "prompt"),
    ],
)
def test_pipelines_we_cannot_reproduce_are_refused(
    tmp_path: Path, modules: list[str], pooling: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        read_pooler_config(write_st(tmp_path, modules, pooling), HF, HIDDEN)


def test_matryoshka_dimensions_come_from_config_json(tmp_path: Path) -> None:
    hf = SimpleNamespace(matryoshka_dimensions=[4, 2, 64])
    config = read_pooler_config(None, hf, HIDDEN)
    assert config.is_matryoshka and config.matryoshka_dimensions == [2, 4]


def test_runner_resolution_follows_vllm() -> None:
    assert is_pooling_runner("auto", "auto", has_lm_head=False)
    assert not is_pooling_runner("auto", "auto", has_lm_head=True)
    assert is_pooling_runner("auto", "embed", has_lm_head=True)
    with pytest.raises(ValueError, match="--runner pooling"):
        is_pooling_runner("generate", "auto", has_lm_head=False)


def test_a_rank_refuses_requests_of_the_other_kind() -> None:
    """A peer's data is checked too: a pooling rank takes pooling requests only, and the
    reverse (the core refuses them first; a rank must not run them if it did not)."""
    from splitserve_contracts.sampling_types import SamplerParams
    from worker_svc.runner.input_batch import InputBatch
    from worker_svc.sample.sampling_metadata import SamplingStates
    from worker_svc.scheduler_output import NewRequestData, SchedulerOutput

    def step(task: str) -> SchedulerOutput:
        new = NewRequestData(
            req_handle=1,
            request_id="r",
            prompt_token_ids=np.array([1, 2, 3]),
            sampling=SamplerParams(),
            block_ids=np.array([1]),
            pooling_task=task,
        )
        return SchedulerOutput(
            step_id=1,
            scheduled_new_reqs=[new],
            num_scheduled_tokens=np.array([3]),
            total_num_scheduled_tokens=3,
        )

    for is_pooling, task in ((True, ""), (False, "embed")):
        batch = InputBatch(
            max_model_len=64,
            block_size=16,
            vocab_size=32,
            num_kv_blocks=8,
            capacity=2,
            sampling=SamplingStates(2, 32, torch.device("cpu")),
            is_pooling=is_pooling,
        )
        assert "pooling_task" in batch.update_states(step(task)).failed[1]
        assert not batch.update_states(step("embed" if is_pooling else "")).failed


@pytest.mark.parametrize(
    "architecture", ["BertForSequenceClassification", "XLMRobertaForSequenceClassification"]
)
def test_encoder_only_models_but_bert_model_are_refused_in_one_line(architecture: str) -> None:
    from worker_svc.models.registry import UnsupportedArchitectureError, pooling_model_class

    with pytest.raises(UnsupportedArchitectureError, match="encoder-only") as refused:
        pooling_model_class(architecture)
    assert "\n" not in str(refused.value)

"""One rank in this process serving a BertModel embedder (encoder-only, bidirectional
attention) saved by sentence-transformers: prompts of different lengths pooled in one step
equal `SentenceTransformer.encode` (cosine >= 0.9999, MEAN pooling; CLS over HTTP and TP=2 in
tests/e2e/test_bert_embeddings.py) with no KV cache allocated, and a step carrying part of a
prompt fails that request alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from splitserve_contracts.sampling_types import SamplerParams
from tests.fixtures.embedder import load_embedder, make_bert_embedder
from tests.fixtures.ranks import LocalRank
from worker_svc.model_loader.model_load import LoadModelConfig
from worker_svc.scheduler_output import NewRequestData, SchedulerOutput

BLOCK_SIZE = 4
TEXTS = ["hello world", "it", "the small model serves a stream of tokens, every word (42x)"]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_bert_embedder(tmp_path_factory.mktemp("bert") / "bert-mean", "mean", seed=4)


@pytest.fixture
def rank(embedder: Path) -> Iterator[LocalRank]:
    rank = LocalRank()
    rank.load(LoadModelConfig.of(str(embedder), block_size=BLOCK_SIZE))
    rank.init(num_blocks=64)
    yield rank
    rank.close()


def pooling_step(step_id: int, prompts: list[list[int]], num_tokens: list[int]) -> SchedulerOutput:
    """New pooling requests 1, 2, ..., each computing its first `num_tokens` tokens."""
    new, first_block = [], 1
    for handle, prompt in enumerate(prompts, start=1):
        num_blocks = -(-len(prompt) // BLOCK_SIZE)
        blocks = np.arange(first_block, first_block + num_blocks)
        first_block += num_blocks
        new.append(NewRequestData(handle, f"r{handle}", np.array(prompt), SamplerParams(), blocks,
                                  pooling_task="embed"))  # fmt: skip
    return SchedulerOutput(
        step_id=step_id,
        scheduled_new_reqs=new,
        num_scheduled_tokens=np.array(num_tokens),
        total_num_scheduled_tokens=sum(num_tokens),
    )


def test_bert_prompts_pooled_in_one_step_equal_sentence_transformers(
    rank: LocalRank, embedder: Path
) -> None:
    reference = load_embedder(embedder)
    prompts = [list(reference.tokenizer(t)["input_ids"]) for t in TEXTS]
    output = rank.execute(pooling_step(1, prompts, [len(p) for p in prompts]))
    assert output is not None and not output.failed_req_handles
    assert [p.req_handle for p in output.pooler_outputs] == [1, 2, 3]
    ours = np.stack([np.frombuffer(p.data, "<f4") for p in output.pooler_outputs])
    ref = reference.encode(TEXTS)
    cosines = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    assert cosines.min() >= 0.9999
    runner = rank.worker.runner
    assert runner is not None and runner.kv_cache is not None
    assert runner.kv_cache.nbytes == 0  # no KV cache at all: attention never reads or writes it


def test_a_step_with_part_of_a_bert_prompt_fails_that_request_alone(rank: LocalRank) -> None:
    prompts = [[2, 40, 41, 42, 3], [2, 50, 51, 52, 53, 54, 3]]
    output = rank.execute(pooling_step(1, prompts, [5, 4]))  # request 2: a first chunk only
    assert output is not None and output.failed_req_handles == [2]
    assert "whole, in one step" in output.failed_reasons[0]
    assert [p.req_handle for p in output.pooler_outputs] == [1]


def test_lora_on_a_bert_model_is_refused_in_one_line(embedder: Path) -> None:
    rank = LocalRank()
    with pytest.raises(ValueError, match="not served on encoder-only") as refused:
        rank.load(LoadModelConfig.of(str(embedder), block_size=BLOCK_SIZE, max_loras=1))
    assert "\n" not in str(refused.value)

"""An encoder-only embedder (BertModel, the architecture of bge/gte small) end to end with the
openai SDK, at TP=2, against a checkpoint saved by sentence-transformers itself: the vectors
equal sentence-transformers' (cosine >= 0.9999) for prompts of different lengths batched in
steps (each prompt whole, in one step: bidirectional attention); a prompt longer than a step's
token budget or the model's positions gets a 400; no KV blocks stay behind. (TP=1 and MEAN
pooling: tests/parity/test_parity_bert.py.)"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.e2e.stack import Stack
from tests.e2e.test_embeddings import client, cosines, model_name
from tests.fixtures.embedder import load_embedder, make_bert_embedder

pytestmark = pytest.mark.slow
BUDGET = 48
"""--max-num-batched-tokens: the texts below need several steps, each prompt whole in one."""
TEXTS = [
    "hello world",
    "the river runs through the quiet mountain garden at night, and the small model serves "
    "a stream of tokens",  # ~20 tokens
    "every word, both ways: the encoder reads it all at once (42 times)",
    "it",
    "a fast encoder reads the river, the garden and the mountain at night in a quiet stream",
]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_bert_embedder(tmp_path_factory.mktemp("bert") / "bert-cls", "cls", seed=3)


@pytest.fixture(scope="module")
def bert_stack(bert_dir: Path) -> Iterator[Stack]:
    """A bare BertModel checkpoint: --runner auto serves it for pooling; the heads and the MLP
    split over two ranks (row-parallel projections all-reduced)."""
    flags = ["--max-num-batched-tokens", str(BUDGET)]
    running = Stack(bert_dir, tp=2, core_flags=flags)
    yield running.start()
    running.stop()


def _wait_idle(stack: Stack) -> None:
    deadline = time.monotonic() + 20
    while (stats := stack.scheduler_stats()).num_running_reqs or stats.num_used_blocks:
        assert time.monotonic() < deadline, "the core still holds requests or KV blocks"
        time.sleep(0.1)


def test_bert_embeddings_equal_sentence_transformers(bert_stack: Stack, bert_dir: Path) -> None:
    reference = load_embedder(bert_dir)
    lengths = [len(reference.tokenizer(t)["input_ids"]) for t in TEXTS]
    assert len(set(lengths)) == len(TEXTS) and sum(lengths) > BUDGET
    assert reference.tokenizer(TEXTS[0])["input_ids"][0] == reference.tokenizer.cls_token_id
    sdk, model = client(bert_stack), model_name(bert_stack)
    reply = sdk.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    ours = np.array([d.embedding for d in reply.data])
    assert cosines(ours, reference.encode(TEXTS)).min() >= 0.9999
    assert reply.usage.prompt_tokens == sum(lengths)  # [CLS] and [SEP] included, as HF adds them
    again = sdk.embeddings.create(model=model, input=TEXTS[1:3], encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in again.data], ours[1:3], atol=1e-6)
    _wait_idle(bert_stack)  # freed at once: nothing cached, nothing kept


@pytest.mark.parametrize(
    ("num_words", "reason"),
    [(BUDGET, "token budget"), (80, "max_model_len")],
)
def test_too_long_bert_input_gets_a_400(bert_stack: Stack, num_words: int, reason: str) -> None:
    """Longer than a step's budget (the core's refusal: bidirectional attention cannot be
    chunked) or than the model's positions (the frontend's)."""
    body = {"model": model_name(bert_stack), "input": "river " * num_words}
    reply = httpx.post(f"{bert_stack.http}/v1/embeddings", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reason in reply.json()["error"]["message"]
    _wait_idle(bert_stack)

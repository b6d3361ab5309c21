"""/score and /rerank (vLLM's shapes and aliases) with a cross-encoder: a random Qwen3 reranker
with a one-label classification head, as transformers saves it; its scores equal
sentence-transformers' CrossEncoder on the same files."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.e2e.pooling_stack import pooling_stack, post
from tests.e2e.stack import Stack
from tests.fixtures.embedder import classifier_logits, load_cross_encoder, make_cross_encoder

pytestmark = pytest.mark.slow
QUERY = "where does the river run"
DOCUMENTS = [
    "the river runs through the quiet mountain garden",
    "a small model serves a stream of tokens",
    "water in the city at night " * 6,  # longer than one 16-token chunk
]


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_cross_encoder(tmp_path_factory.mktemp("rerankers") / "qwen3-rerank", "qwen3")


@pytest.fixture(scope="module")
def rerank_stack(reranker_dir: Path) -> Iterator[Stack]:
    """A Qwen3ForSequenceClassification checkpoint: --runner auto serves it for pooling."""
    yield from pooling_stack(reranker_dir)


def test_scores_equal_the_cross_encoder(rerank_stack: Stack, reranker_dir: Path) -> None:
    want = load_cross_encoder(reranker_dir).predict([(QUERY, d) for d in DOCUMENTS])
    for path in ("/score", "/v1/score"):
        reply = post(rerank_stack, path, {"text_1": QUERY, "text_2": DOCUMENTS})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        got = [d["score"] for d in body["data"]]
        np.testing.assert_allclose(got, want, atol=1e-5)
        assert body["object"] == "list" and body["usage"]["prompt_tokens"] > 0
    pairwise = post(rerank_stack, "/score", {"text_1": [QUERY] * 3, "text_2": DOCUMENTS}).json()
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]], want, atol=1e-5)


def test_rerank_orders_documents_best_first(rerank_stack: Stack, reranker_dir: Path) -> None:
    want = load_cross_encoder(reranker_dir).predict([(QUERY, d) for d in DOCUMENTS])
    best_first = sorted(range(3), key=lambda i: -want[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = {"query": QUERY, "documents": DOCUMENTS, "top_n": 2}
        reply = post(rerank_stack, path, body)
        assert reply.status_code == 200, reply.text
        results = reply.json()["results"]
        assert [r["index"] for r in results] == best_first[:2]
        assert [r["document"]["text"] for r in results] == [DOCUMENTS[i] for i in best_first[:2]]
        np.testing.assert_allclose(
            [r["relevance_score"] for r in results], [want[i] for i in best_first[:2]], atol=1e-5
        )


def test_classify_gives_the_one_labels_sigmoid(rerank_stack: Stack, reranker_dir: Path) -> None:
    """/classify on a one-label head: its sigmoid (vLLM's activation for one label)."""
    logits = classifier_logits(reranker_dir, DOCUMENTS)
    reply = post(rerank_stack, "/classify", {"input": DOCUMENTS})
    assert reply.status_code == 200, reply.text
    data = reply.json()["data"]
    np.testing.assert_allclose([d["probs"] for d in data], 1 / (1 + np.exp(-logits)), atol=1e-5)
    assert {(d["label"], d["num_classes"]) for d in data} == {("LABEL_0", 1)}
    raw = post(rerank_stack, "/classify", {"input": "a", "use_activation": False})
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "use_activation"


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, 400),
        ("/score", {"text_1": "a"}, 400),
        ("/score", {"text_1": "a", "text_2": []}, 400),
        ("/rerank", {"query": "a", "documents": "not a list"}, 400),
        ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, 400),
        ("/rerank", {"query": "a", "documents": ["b " * 400]}, 400),
        ("/v1/embeddings", {"input": "a"}, 400),  # a reranker is not an embedder
        ("/v1/completions", {"prompt": "a", "max_tokens": 2}, 400),
    ],
)
def test_bad_requests_get_a_400(
    rerank_stack: Stack, path: str, body: dict[str, Any], status: int
) -> None:
    reply = post(rerank_stack, path, body)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["message"]


def test_score_on_a_generation_engine_is_refused(stack: Stack) -> None:
    reply = post(stack, "/score", {"text_1": "a", "text_2": "b"})
    assert reply.status_code == 400 and "Score API" in reply.json()["error"]["message"]

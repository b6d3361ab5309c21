"""/classify and /pooling (vLLM's shapes) with a sequence classifier: a random Qwen3 decoder with
a three-label head, as transformers saves it. Its probabilities equal the softmax of
transformers' AutoModelForSequenceClassification logits on the same files, its labels are
config.json's id2label, and bad input gets a 400 naming its field. (/pooling with an embedder:
tests/e2e/test_embeddings.py; /classify with a one-label reranker: test_score_rerank.py.)"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.e2e.pooling_stack import pooling_stack, post
from tests.e2e.stack import Stack
from tests.fixtures.embedder import classifier_logits, make_cross_encoder

pytestmark = pytest.mark.slow
LABELS = ("negative", "neutral", "positive")
TEXTS = [
    "the river runs through the quiet mountain garden",
    "a small model serves a stream of tokens",
    "water in the city at night " * 6,  # longer than one 16-token chunk
]


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("classifiers") / "qwen3-cls"
    return make_cross_encoder(path, "qwen3", seed=3, labels=LABELS)


@pytest.fixture(scope="module")
def classify_stack(classifier_dir: Path) -> Iterator[Stack]:
    yield from pooling_stack(classifier_dir)


def test_classify_equals_transformers(classify_stack: Stack, classifier_dir: Path) -> None:
    logits = classifier_logits(classifier_dir, TEXTS)
    want = torch.softmax(torch.from_numpy(logits).double(), -1).numpy()
    reply = post(classify_stack, "/classify", {"input": TEXTS})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "list" and body["id"].startswith("classify-")
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    np.testing.assert_allclose([d["probs"] for d in body["data"]], want, atol=1e-5)
    assert [d["label"] for d in body["data"]] == [LABELS[i] for i in want.argmax(1)]
    assert {d["num_classes"] for d in body["data"]} == {3}
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0


def test_pooling_gives_the_probs_or_the_raw_logits(
    classify_stack: Stack, classifier_dir: Path
) -> None:
    logits = classifier_logits(classifier_dir, TEXTS[:1])
    probs = post(classify_stack, "/classify", {"input": TEXTS[0]}).json()["data"][0]["probs"]
    reply = post(classify_stack, "/pooling", {"input": TEXTS[0]})
    assert reply.status_code == 200, reply.text
    item = reply.json()["data"][0]
    assert item["object"] == "pooling"
    np.testing.assert_allclose(item["data"], probs, atol=1e-6)
    raw = {"input": [TEXTS[0]], "use_activation": False, "encoding_format": "base64"}
    encoded = post(classify_stack, "/pooling", {**raw, "task": "classify"}).json()
    got = np.frombuffer(base64.b64decode(encoded["data"][0]["data"]), dtype="<f4")
    np.testing.assert_allclose(got, logits[0], atol=1e-4)


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/classify", {}, "input"),
        ("/classify", {"input": []}, "input"),
        ("/classify", {"input": [[1, 2, 999999]]}, "input"),
        ("/classify", {"input": "a", "use_activation": "no"}, "use_activation"),
        ("/classify", {"input": "a", "messages": [{"role": "user"}]}, "messages"),
        ("/classify", {"input": "a", "model": "other"}, None),  # 404
        ("/pooling", {"input": "a", "task": "token_classify"}, "task"),
        ("/pooling", {"input": "a", "task": "embed"}, "model"),
        ("/pooling", {"input": "a", "encoding_format": "bytes"}, "encoding_format"),
        ("/score", {"text_1": "a", "text_2": "b"}, "model"),  # three labels: not a reranker
    ],
)
def test_bad_requests_get_a_400(
    classify_stack: Stack, path: str, body: dict[str, Any], field: str | None
) -> None:
    reply = post(classify_stack, path, body)
    assert reply.status_code == (400 if field else 404), reply.text
    error = reply.json()["error"]
    assert error["message"] and error["param"] == field
    assert post(classify_stack, "/classify", {"input": "still serving"}).status_code == 200


def test_classify_on_a_generation_engine_is_refused(stack: Stack) -> None:
    for path in ("/classify", "/pooling"):
        reply = post(stack, path, {"input": "a"})
        assert reply.status_code == 400 and "does not support" in reply.json()["error"]["message"]

"""A classifier head's activation and labels as config.json describes them (vLLM's and
transformers' rules), and a malformed config.json that must not take /classify down."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from frontend_svc.serving.classification import ClassifierHead

LOGITS = np.array([0.5, -1.25, 2.0], dtype=np.float32)


@pytest.mark.parametrize(
    ("problem_type", "want"),
    [
        (None, torch.softmax(torch.tensor(LOGITS), -1).numpy()),
        ("single_label_classification", torch.softmax(torch.tensor(LOGITS), -1).numpy()),
        ("multi_label_classification", torch.sigmoid(torch.tensor(LOGITS)).numpy()),
        ("regression", LOGITS),
    ],
)
def test_the_activation_follows_problem_type(problem_type: str | None, want: Any) -> None:
    head = ClassifierHead.from_config({"problem_type": problem_type})
    np.testing.assert_allclose(head.probs(LOGITS, True), want, rtol=1e-6)
    np.testing.assert_array_equal(head.probs(LOGITS, False), LOGITS)


def test_a_one_label_score_is_already_through_its_sigmoid() -> None:
    score = np.array([0.75], dtype=np.float32)
    np.testing.assert_array_equal(ClassifierHead().probs(score, True), score)


def test_softmax_does_not_overflow() -> None:
    probs = ClassifierHead().probs(np.array([1e4, 0.0], dtype=np.float32), True)
    np.testing.assert_allclose(probs, [1.0, 0.0])


@pytest.mark.parametrize(
    ("config", "want"),
    [
        ({"id2label": {"0": "neg", "1": "pos"}}, ["neg", "pos", "LABEL_2"]),
        ({}, ["LABEL_0", "LABEL_1", "LABEL_2"]),
        ({"id2label": ["neg", "pos"]}, ["LABEL_0", "LABEL_1", "LABEL_2"]),
        ({"id2label": {"zero": "neg"}}, ["LABEL_0", "LABEL_1", "LABEL_2"]),
        ({"id2label": {"0": "x" * 10_000}, "problem_type": 7}, ["x" * 256, "LABEL_1", "LABEL_2"]),
    ],
)
def test_labels_come_from_id2label_or_fall_back(config: dict[str, Any], want: list[str]) -> None:
    head = ClassifierHead.from_config(config)
    assert [head.label(i) for i in range(3)] == want
    assert head.problem_type in ("", "single_label_classification")

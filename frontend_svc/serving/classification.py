"""A sequence classifier's outputs as vLLM's /classify and /pooling give them: each label's
probability after the head's activation, and the label of the most probable class.

The engine sends the head's scores: a one-label head's already through its sigmoid (the
cross-encoder's relevance, what /score returns), any other head's raw logits. The activation
follows the checkpoint's `problem_type` as transformers' loss does (vLLM's
get_classification_act_fn): softmax for single-label classification (the default), sigmoid for
multi-label classification, none for regression. Labels come from config.json's `id2label`
(transformers' LABEL_<i> where it names none)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)
MAX_LABEL_CHARS = 256
MAX_LABELS = 1 << 16


@dataclass(frozen=True)
class ClassifierHead:
    """What the frontend reads of a classifier's config.json."""

    id2label: Mapping[int, str] = field(default_factory=dict)
    problem_type: str = ""

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ClassifierHead:
        """The head config.json describes ({}: the defaults); a malformed `id2label` is
        ignored (logged), so the labels fall back to LABEL_<i>."""
        problem_type = config.get("problem_type")
        if not isinstance(problem_type, str):
            problem_type = ""
        return cls(_id2label(config.get("id2label")), problem_type)

    def label(self, index: int) -> str:
        return self.id2label.get(index, f"LABEL_{index}")

    def probs(self, scores: np.ndarray, use_activation: bool) -> np.ndarray:
        """The classes' probabilities (`use_activation` False: the head's raw scores; a
        one-label head's score is already through its sigmoid, which ran on the workers)."""
        if scores.size == 1 or not use_activation or self.problem_type == "regression":
            return scores
        wide = scores.astype(np.float64)
        if self.problem_type == "multi_label_classification":
            return (1.0 / (1.0 + np.exp(-wide))).astype(np.float32)
        shifted = np.exp(wide - wide.max())
        return (shifted / shifted.sum()).astype(np.float32)


def _id2label(value: Any) -> dict[int, str]:
    if value is None:
        return {}
    try:
        if not isinstance(value, dict) or len(value) > MAX_LABELS:
            raise ValueError("not an object of at most 65536 labels")
        labels = {int(k): str(v)[:MAX_LABEL_CHARS] for k, v in value.items()}
    except (TypeError, ValueError) as err:
        logger.warning("config.json: id2label is malformed (%s); labels are LABEL_<i>", err)
        return {}
    return labels

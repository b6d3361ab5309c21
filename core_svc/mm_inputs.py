"""A request's multimodal items as the engine core sees them (vLLM's MultiModalFeatureSpec).

The core reads only where each item's placeholder tokens sit and its content hash; the item
itself (the encoder input) stays serialized, kept until the request finishes (a recompute after
a preemption or a recovery may need the encoder again) and forwarded to the workers untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve_contracts.mm_features import grid_problem


@dataclass(frozen=True, slots=True)
class MultiModalFeatureSpec:
    """One item: placeholder tokens [offset, offset + length) of the prompt."""

    identifier: str
    """Content hash of the encoder input; keys the workers' encoder cache."""
    offset: int
    length: int
    serialized: bytes = b""
    """The whole common.v1.MultiModalFeature, as the frontend sent it."""
    grid_thw: tuple[int, ...] = ()
    """A dynamic-resolution image's patch grid (empty: fixed size), checked against the rows
    of its pixel values (`num_patches`)."""
    num_patches: int = 0

    @property
    def end(self) -> int:
        return self.offset + self.length


def mm_features_problem(
    features: tuple[MultiModalFeatureSpec, ...], num_prompt_tokens: int, max_tokens_per_item: int
) -> str | None:
    """Why these items cannot run with this prompt on this model, or None."""
    if not features:
        return None
    if max_tokens_per_item == 0:
        return "the request carries images but the model takes text only"
    previous_end = 0
    for i, feature in enumerate(features):
        if not feature.identifier or len(feature.identifier) > 128:
            return f"mm_features[{i}] has no valid identifier"
        if not 0 < feature.length <= max_tokens_per_item:
            return (
                f"mm_features[{i}] has {feature.length} placeholder tokens; the model's items "
                f"take 1..{max_tokens_per_item}"
            )
        problem = grid_problem(feature.grid_thw, feature.num_patches)
        if problem is not None:
            return f"mm_features[{i}]: {problem}"
        if feature.offset < previous_end or feature.end > num_prompt_tokens:
            return f"mm_features[{i}]'s placeholders overlap another item or leave the prompt"
        previous_end = feature.end
    return None

"""Speculative decoding's shared rules: the configuration (vLLM's `--speculative-config`) and the
n-gram proposer (vLLM's NgramProposer, prompt lookup).

The proposer is part of the contract between the engine core and the ranks: every rank proposes
the drafts of its decoding requests itself, from the token ids it holds (so drafts never travel
on the step), and the engine core computes the same drafts from the same tokens when it needs
them (a constrained request's grammar masks one row per draft position). Both sides call
`propose_ngram` on the same tokens, so they agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from splitserve_contracts.json_object import parse_json_object

SPECULATIVE_METHODS = ("ngram",)
"""Methods this engine runs (vLLM's `method`); suffix decoding, draft models and EAGLE heads are
not implemented (they would propose on the ranks too: docs/ARCHITECTURE.md)."""
MAX_SPECULATIVE_TOKENS = 16
"""Most draft tokens per request per step that the ranks accept (vLLM has no cap; past a few
tokens the n-gram's acceptance falls off and the verification costs more than it wins)."""
DEFAULT_PROMPT_LOOKUP = 5
"""vLLM's prompt_lookup_min/max when neither is given (both 5)."""
DEFAULT_MAX_SPEC_BATCH = 8
"""Running requests up to which a step speculates unless `num_speculative_tokens_per_batch_size`
says otherwise. On a CPU a step of 1 + k tokens per request stops being free once the batch's
matmuls are no longer bound by reading the weights; `benchmarks/spec_decode.py --crossover`
measures where (docs/benchmarks.md: not pinned down yet, the shared 2-core machine's noise is
larger than the effect around this size), so this is a conservative estimate."""

_KEYS = {
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "num_speculative_tokens_per_batch_size",
}


class InvalidSpeculativeConfig(ValueError):
    """The --speculative-config value cannot be used; the message says what to change."""


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """How drafts are proposed and how many a step schedules per request."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] = ()
    """vLLM's dynamic schedule: (first, last, k) batch-size ranges; empty: the default (k up to
    DEFAULT_MAX_SPEC_BATCH running requests, 0 above)."""

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise InvalidSpeculativeConfig(
                f"method {self.method!r} is not available; this engine runs "
                f"{', '.join(SPECULATIVE_METHODS)} (suffix decoding, draft models and EAGLE "
                "heads are not implemented)"
            )
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise InvalidSpeculativeConfig(
                f"num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, got "
                f"{self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise InvalidSpeculativeConfig(
                f"prompt_lookup_min={self.prompt_lookup_min} must be >= 1 and <= "
                f"prompt_lookup_max={self.prompt_lookup_max}"
            )

    def num_spec_tokens_for_batch(self, max_num_seqs: int) -> list[int]:
        """Dense lookup: entry b is k for a step with b running requests (b in 1..max_num_seqs;
        entry 0 unused), as vLLM's build_dynamic_sd_schedule_lookup: a gap carries the previous
        range's k forward, and so does the tail after the last range."""
        k = self.num_speculative_tokens
        schedule = self.num_speculative_tokens_per_batch_size or (
            (1, DEFAULT_MAX_SPEC_BATCH, k),
            (DEFAULT_MAX_SPEC_BATCH + 1, DEFAULT_MAX_SPEC_BATCH + 1, 0),
        )
        lookup = [0] * (max_num_seqs + 1)
        next_batch, last = 1, 0
        for first, end, value in schedule:
            for batch in range(next_batch, min(first, max_num_seqs + 1)):
                lookup[batch] = min(k, last)  # a gap: the previous range's k
            for batch in range(max(first, next_batch), min(end, max_num_seqs) + 1):
                lookup[batch] = min(k, value)
            next_batch, last = max(next_batch, end + 1), value
        for batch in range(next_batch, max_num_seqs + 1):
            lookup[batch] = min(k, last)
        return lookup


def parse_speculative_config(text: str) -> SpeculativeConfig | None:
    """--speculative-config: vLLM's JSON object (method, num_speculative_tokens,
    prompt_lookup_min/max, num_speculative_tokens_per_batch_size); "" or "{}" or "null": none."""
    value = parse_json_object(text, InvalidSpeculativeConfig)
    return None if value is None else speculative_config_from_dict(value)


def speculative_config_from_dict(value: dict[str, Any]) -> SpeculativeConfig:
    """vLLM's keys and defaults: method "ngram" (also given as model "[ngram]"), both lookup
    bounds 5 when neither is given, else the missing one equal to the other."""
    unknown = set(value) - _KEYS
    if unknown:
        raise InvalidSpeculativeConfig(
            f"unknown keys {sorted(unknown)}; this engine reads {sorted(_KEYS)}"
        )
    method = value.get("method") or value.get("model")
    if method in ("[ngram]", "ngram"):
        method = "ngram"
    if not isinstance(method, str):
        raise InvalidSpeculativeConfig('"method" is required, e.g. {"method": "ngram", ...}')
    k = _int(value, "num_speculative_tokens", None)
    low = _int(value, "prompt_lookup_min", 0)
    high = _int(value, "prompt_lookup_max", 0)
    if not low and not high:
        low = high = DEFAULT_PROMPT_LOOKUP
    low, high = low or high, high or low
    return SpeculativeConfig(
        method=method,
        num_speculative_tokens=k,
        prompt_lookup_min=low,
        prompt_lookup_max=high,
        num_speculative_tokens_per_batch_size=_schedule(
            value.get("num_speculative_tokens_per_batch_size")
        ),
    )


def _int(value: dict[str, Any], key: str, default: int | None) -> int:
    got = value.get(key, default)
    if got is None:
        raise InvalidSpeculativeConfig(f'"{key}" is required')
    if isinstance(got, bool) or not isinstance(got, int) or got < 0:
        raise InvalidSpeculativeConfig(f'"{key}" must be a non-negative integer, got {got!r}')
    return got


def _schedule(value: object) -> tuple[tuple[int, int, int], ...]:
    """vLLM's validate_and_normalize_dynamic_sd_schedule: inclusive, positive, sorted,
    non-overlapping (first, last, k) ranges, the first starting at 1."""
    if value is None:
        return ()
    if not isinstance(value, list) or not value:
        raise InvalidSpeculativeConfig(
            "num_speculative_tokens_per_batch_size must be a non-empty list of "
            "[range_start, range_end, num_speculative_tokens]"
        )
    ranges = []
    for entry in value:
        if (
            not isinstance(entry, list | tuple)
            or len(entry) != 3
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in entry)
        ):
            raise InvalidSpeculativeConfig(
                f"each num_speculative_tokens_per_batch_size entry is [start, end, k], got {entry!r}"
            )
        first, end, k = entry
        if first <= 0 or end < first or k < 0:
            raise InvalidSpeculativeConfig(f"bad batch-size range {entry!r}")
        ranges.append((first, end, k))
    ranges.sort()
    if ranges[0][0] != 1 or any(b[0] <= a[1] for a, b in zip(ranges, ranges[1:], strict=False)):
        raise InvalidSpeculativeConfig(
            "num_speculative_tokens_per_batch_size ranges must start at 1 and not overlap"
        )
    return tuple(ranges)


def propose_ngram(
    tokens: npt.NDArray[np.integer[Any]] | Sequence[int],
    min_n: int,
    max_n: int,
    k: int,
    max_model_len: int,
) -> npt.NDArray[np.int64]:
    """vLLM's n-gram proposal: the longest n (min_n <= n <= max_n) whose last n tokens occur
    earlier in `tokens` (ending before the last token), at its earliest occurrence; the drafts are
    the up to k tokens that followed it there (fewer near the end of `tokens` or of
    max_model_len). Empty when nothing matches."""
    array = np.asarray(tokens, dtype=np.int64)
    num_tokens = len(array)
    k = min(k, max_model_len - num_tokens)
    if num_tokens < min_n or k <= 0 or num_tokens < 2:
        return array[:0]
    # Candidate ends: earlier positions holding the last token (the n-gram's last one).
    ends = np.flatnonzero(array[:-1] == array[-1])
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        starts = ends[ends >= n - 1] - (n - 1)
        if not len(starts):
            continue
        window = array[starts[:, None] + np.arange(n - 1)]
        hits = starts[(window == array[num_tokens - n : -1]).all(axis=1)]
        if len(hits):
            first = int(hits[0]) + n
            return array[first : first + min(k, num_tokens - first)]
    return array[:0]

"""The rules of the sampling vocabulary, in one place: which values each field accepts, how vLLM
normalises them, and what "greedy" means.

Every trust boundary calls `validate`: the frontend on what clients send (SamplingParams), the
workers on what the engine core forwards (SamplerParams). Rules are keyed by field name and apply
to whichever of the two views carries the field, so a new field gets its rule in the table below
and nowhere else.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from splitserve_contracts.sampling_types import SamplerParams, SamplingParams

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this sample greedily (argmax), as in vLLM."""
LOGIT_BIAS_LIMIT = 100.0
"""logit_bias values are clamped to [-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT]."""
MAX_REPETITION_PENALTY = 100.0
"""Beyond this a penalty only degenerates (logits / 1e30 are all ~0); refused."""


class InvalidSamplingParams(ValueError):
    """A value outside what the contract allows; the message says what to change, `field`
    which field it is."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on what one request may ask for."""

    vocab_size: int
    max_logprobs: int = 20
    max_n: int = 64
    max_stop_strings: int = 32
    max_stop_string_chars: int = 256
    max_token_id_list: int = 4096


Check = Callable[[Any, Limits], str | None]
"""A rule: None when the value is fine, else what is wrong with it."""


def _within(lo: float, hi: float | Callable[[Limits], float]) -> Check:
    def check(value: Any, limits: Limits) -> str | None:
        top = hi(limits) if callable(hi) else hi
        return None if lo <= value <= top else f"must be in [{lo:g}, {top:g}]"

    return check


def _at_least(lo: float) -> Check:
    return lambda value, _: None if value is None or value >= lo else f"must be >= {lo:g}"


def _finite_at_least(lo: float) -> Check:
    def check(value: float, _: Limits) -> str | None:
        return None if math.isfinite(value) and value >= lo else f"must be finite and >= {lo:g}"

    return check


def _repetition_penalty(value: float, _: Limits) -> str | None:
    ok = 0.0 < value <= MAX_REPETITION_PENALTY
    return None if ok else f"must be in (0, {MAX_REPETITION_PENALTY:g}]"


def _top_p(value: float, _: Limits) -> str | None:
    return None if 0.0 < value <= 1.0 else "must be in (0, 1]"


INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _top_k(value: int, _: Limits) -> str | None:
    if -1 <= value <= INT32_MAX:
        return None
    return f"must be -1 (disabled), 0 (disabled) or in [1, {INT32_MAX}]"


def _optional_within(lo: int, hi: int) -> Check:
    """An integer in [lo, hi] (the contract field's wire range), or None."""

    def check(value: int | None, _: Limits) -> str | None:
        if value is None or lo <= value <= hi:
            return None
        return f"must be >= {lo}" if value < lo else f"must be <= {hi}"

    return check


def _logprobs(value: int | None, limits: Limits) -> str | None:
    return None if value is None else _within(0, limits.max_logprobs)(value, limits)


RULES: dict[str, Check] = {
    "n": _within(1, lambda limits: limits.max_n),
    "temperature": _finite_at_least(0.0),
    "top_p": _top_p,
    "top_k": _top_k,
    "min_p": _within(0.0, 1.0),
    "presence_penalty": _within(-2.0, 2.0),
    "frequency_penalty": _within(-2.0, 2.0),
    "repetition_penalty": _repetition_penalty,
    "max_tokens": _optional_within(1, UINT32_MAX),
    "min_tokens": _optional_within(0, UINT32_MAX),
    "seed": _optional_within(INT64_MIN, INT64_MAX),
    "logprobs": _logprobs,
    "prompt_logprobs": _logprobs,
}
"""Per-field range rules, by field name."""
TOKEN_ID_FIELDS = ("stop_token_ids", "allowed_token_ids", "logit_bias")
"""Fields holding token ids (logit_bias: its keys); each id must be in the vocabulary."""

AnyParams = SamplingParams | SamplerParams


def is_greedy(params: AnyParams) -> bool:
    return params.temperature < GREEDY_TEMPERATURE


def validate(params: AnyParams, limits: Limits) -> None:
    """Raise InvalidSamplingParams for the first value outside its documented range."""
    names = {f.name for f in dataclasses.fields(params)}
    for name, check in RULES.items():
        if name in names:
            problem = check(getattr(params, name), limits)
            if problem is not None:
                _fail(f"{name} {problem}, got {getattr(params, name)}", name)
    for name in TOKEN_ID_FIELDS:
        if name in names:
            _check_token_ids(name, getattr(params, name), limits)
    if not all(math.isfinite(v) for v in params.logit_bias.values()):
        _fail("logit_bias values must be finite numbers", "logit_bias")
    if isinstance(params, SamplingParams):
        _check_cross_field(params, limits)


def _fail(message: str, field: str = "") -> None:
    raise InvalidSamplingParams(message, field)


def _check_token_ids(name: str, ids: Iterable[int], limits: Limits) -> None:
    ids = sorted(ids) if isinstance(ids, dict) else list(ids)
    label = f"{name} keys" if name == "logit_bias" else name
    if len(ids) > limits.max_token_id_list:
        _fail(
            f"{label} has {len(ids)} entries; at most {limits.max_token_id_list} are allowed", name
        )
    for i, token_id in enumerate(ids):
        if not 0 <= token_id < limits.vocab_size:
            _fail(
                f"{label}[{i}] = {token_id} is outside the vocabulary (valid ids: 0.."
                f"{limits.vocab_size - 1})",
                name,
            )


def _check_cross_field(p: SamplingParams, limits: Limits) -> None:
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        _fail(
            f"min_tokens ({p.min_tokens}) must not exceed max_tokens ({p.max_tokens})", "min_tokens"
        )
    if p.n > 1 and is_greedy(p):
        _fail(
            f"n = {p.n} with greedy sampling (temperature 0) would return {p.n} identical "
            "completions; set temperature > 0 or n = 1",
            "n",
        )
    if len(p.stop) > limits.max_stop_strings:
        _fail(
            f"{len(p.stop)} stop strings given; at most {limits.max_stop_strings} are allowed",
            "stop",
        )
    for i, text in enumerate(p.stop):
        if not 0 < len(text) <= limits.max_stop_string_chars:
            _fail(
                f"stop[{i}] must have 1..{limits.max_stop_string_chars} characters, got {len(text)}",
                "stop",
            )


def normalize(p: SamplingParams) -> SamplingParams:
    """vLLM's normalisations: greedy disables the filters; top_k -1 means 0 (disabled); logit
    bias is clamped to [-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT]."""
    changes: dict[str, Any] = {}
    if is_greedy(p):
        changes.update(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0)
    if p.top_k == -1:
        changes["top_k"] = 0
    if any(abs(v) > LOGIT_BIAS_LIMIT for v in p.logit_bias.values()):
        changes["logit_bias"] = {k: _clamp_bias(v) for k, v in p.logit_bias.items()}
    return dataclasses.replace(p, **changes) if changes else p


def clamp_top_k(params: SamplingParams, vocab_size: int) -> SamplingParams:
    """top_k above the vocabulary keeps every token, as vLLM clamps it."""
    if params.top_k > vocab_size:
        return dataclasses.replace(params, top_k=vocab_size)
    return params


def child_seed(seed: int | None, index: int) -> int | None:
    """The seed of completion `index` of an n > 1 request: seed + index, wrapped into int64."""
    if seed is None:
        return None
    return (seed + index + 2**63) % 2**64 - 2**63


def _clamp_bias(value: float) -> float:
    return max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, value))

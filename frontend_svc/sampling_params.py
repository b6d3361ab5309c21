"""The frontend's view of sampling parameters: vLLM's defaults resolved, ranges validated."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

GREEDY_EPSILON = 1e-5


class InvalidRequest(ValueError):
    """A request the frontend refuses; the message tells the caller what to change."""


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on what one request may ask for."""

    max_model_len: int
    vocab_size: int
    max_logprobs: int = 20
    max_n: int = 64
    max_stop_strings: int = 32
    max_stop_string_chars: int = 256
    max_token_id_list: int = 4096


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """vLLM's SamplingParams with every default resolved (see common/v1/types.proto)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    max_tokens: int | None = None
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: tuple[int, ...] = ()
    spaces_between_special_tokens: bool = True

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def stop_buffer_length(self) -> int:
        """Characters held back while streaming so a partial stop string never leaks."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    def replace(self, **changes: object) -> SamplingParams:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def _check(is_ok: bool, message: str) -> None:
    if not is_ok:
        raise InvalidRequest(message)


def _check_token_ids(name: str, ids: tuple[int, ...] | list[int], limits: Limits) -> None:
    _check(
        len(ids) <= limits.max_token_id_list,
        f"{name} has {len(ids)} entries; at most {limits.max_token_id_list} are allowed",
    )
    for i, token_id in enumerate(ids):
        _check(
            0 <= token_id < limits.vocab_size,
            f"{name}[{i}] = {token_id} is outside the vocabulary (valid ids: 0.."
            f"{limits.vocab_size - 1})",
        )


def validate_ranges(p: SamplingParams, limits: Limits) -> None:
    """Raise InvalidRequest for any value outside its documented range."""
    _check(1 <= p.n <= limits.max_n, f"n must be in [1, {limits.max_n}], got {p.n}")
    _check(p.temperature >= 0.0, f"temperature must be >= 0, got {p.temperature}")
    _check(0.0 < p.top_p <= 1.0, f"top_p must be in (0, 1], got {p.top_p}")
    _check(p.top_k >= -1, f"top_k must be -1 (disabled), 0 (disabled) or >= 1, got {p.top_k}")
    _check(0.0 <= p.min_p <= 1.0, f"min_p must be in [0, 1], got {p.min_p}")
    _check(
        -2.0 <= p.presence_penalty <= 2.0,
        f"presence_penalty must be in [-2, 2], got {p.presence_penalty}",
    )
    _check(
        -2.0 <= p.frequency_penalty <= 2.0,
        f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}",
    )
    _check(
        p.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {p.repetition_penalty}"
    )
    _check(
        p.max_tokens is None or p.max_tokens >= 1, f"max_tokens must be >= 1, got {p.max_tokens}"
    )
    _check(
        p.max_tokens is None or p.min_tokens <= p.max_tokens,
        f"min_tokens ({p.min_tokens}) must not exceed max_tokens ({p.max_tokens})",
    )
    for name, value in (("logprobs", p.logprobs), ("prompt_logprobs", p.prompt_logprobs)):
        _check(
            value is None or 0 <= value <= limits.max_logprobs,
            f"{name} must be in [0, {limits.max_logprobs}], got {value}",
        )
    _check(
        not (p.n > 1 and p.is_greedy),
        f"n = {p.n} with greedy sampling (temperature 0) would return {p.n} identical "
        "completions; set temperature > 0 or n = 1",
    )
    _check_stop_strings(p, limits)
    _check_token_ids("stop_token_ids", p.stop_token_ids, limits)
    _check_token_ids("allowed_token_ids", p.allowed_token_ids, limits)
    _check_token_ids("logit_bias keys", sorted(p.logit_bias), limits)


def _check_stop_strings(p: SamplingParams, limits: Limits) -> None:
    _check(
        len(p.stop) <= limits.max_stop_strings,
        f"{len(p.stop)} stop strings given; at most {limits.max_stop_strings} are allowed",
    )
    for i, text in enumerate(p.stop):
        _check(
            0 < len(text) <= limits.max_stop_string_chars,
            f"stop[{i}] must have 1..{limits.max_stop_string_chars} characters, got {len(text)}",
        )


def normalize(p: SamplingParams) -> SamplingParams:
    """vLLM's normalisations: greedy disables the filters; logit bias is clamped to [-100, 100]."""
    changes: dict[str, object] = {}
    if p.is_greedy:
        changes.update(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0)
    if p.top_k == -1:
        changes["top_k"] = 0
    if any(abs(v) > 100.0 for v in p.logit_bias.values()):
        changes["logit_bias"] = {k: max(-100.0, min(100.0, v)) for k, v in p.logit_bias.items()}
    return p.replace(**changes) if changes else p

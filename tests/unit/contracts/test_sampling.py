"""The sampling vocabulary: generated views, descriptor-driven conversion, the shared rules."""

from __future__ import annotations

import dataclasses

import pytest

from splitserve_contracts import sampling_convert, sampling_rules
from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.sampling_rules import InvalidSamplingParams, Limits
from splitserve_contracts.sampling_types import SamplerParams, SamplingParams

LIMITS = Limits(vocab_size=100)


def test_views_have_every_contract_field_in_contract_order() -> None:
    for message, view in ((types_pb2.SamplingParams, SamplingParams),
                          (types_pb2.SamplerParams, SamplerParams)):  # fmt: skip
        names = [f.name for f in message.DESCRIPTOR.fields]
        assert [f.name for f in dataclasses.fields(view)] == names


def test_the_sampler_params_are_a_subset_with_the_same_meaning() -> None:
    sampling = {f.name: f for f in types_pb2.SamplingParams.DESCRIPTOR.fields}
    for f in types_pb2.SamplerParams.DESCRIPTOR.fields:
        twin = sampling[f.name]
        assert (f.type, f.is_repeated, f.has_presence) == (
            twin.type, twin.is_repeated, twin.has_presence
        ), f.name  # fmt: skip
        assert getattr(SamplerParams(), f.name) == getattr(SamplingParams(), f.name), f.name


def test_unset_fields_take_the_defaults_the_contract_states() -> None:
    params = sampling_convert.from_proto(types_pb2.SamplingParams(), SamplingParams)
    assert params == SamplingParams()
    assert params.temperature == 1.0 and params.top_p == 1.0 and params.n == 1
    assert params.repetition_penalty == 1.0
    assert params.max_tokens is None and params.logprobs is None and params.seed is None
    assert params.skip_special_tokens and params.spaces_between_special_tokens


def test_zero_valued_optional_fields_stay_zero() -> None:
    msg = types_pb2.SamplingParams(
        temperature=0.0, max_tokens=1, logprobs=0, prompt_logprobs=0, seed=0,
        skip_special_tokens=False, spaces_between_special_tokens=False, top_k=-1,
    )  # fmt: skip
    params = sampling_convert.from_proto(msg, SamplingParams)
    assert sampling_rules.is_greedy(params) and params.top_k == -1
    assert (params.max_tokens, params.logprobs, params.prompt_logprobs, params.seed) == (1, 0, 0, 0)
    assert not params.skip_special_tokens and not params.spaces_between_special_tokens
    assert sampling_rules.normalize(params).top_k == 0


FULL = SamplingParams(
    n=3, temperature=0.75, top_p=0.875, top_k=40, min_p=0.0625, seed=1234,
    presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.25,
    stop=("\n\n", "END"), stop_token_ids=(5, 6), ignore_eos=True, max_tokens=77, min_tokens=3,
    logprobs=2, prompt_logprobs=1, skip_special_tokens=False, include_stop_str_in_output=True,
    logit_bias={7: 1.5, 8: -100.0}, allowed_token_ids=(1, 2, 3),
    spaces_between_special_tokens=False,
)  # fmt: skip


def test_sampling_params_round_trip_through_the_wire() -> None:
    wire = sampling_convert.to_proto(FULL, types_pb2.SamplingParams()).SerializeToString()
    assert (
        sampling_convert.from_proto(types_pb2.SamplingParams.FromString(wire), SamplingParams)
        == FULL
    )


def test_sampler_params_copy_exactly_the_samplers_fields() -> None:
    msg = sampling_convert.to_proto(FULL, types_pb2.SamplerParams())
    sampler = sampling_convert.from_proto(msg, SamplerParams)
    for f in dataclasses.fields(SamplerParams):
        assert getattr(sampler, f.name) == getattr(FULL, f.name), f.name
    assert (
        sampling_convert.from_proto(
            sampling_convert.to_proto(SamplingParams(), types_pb2.SamplerParams()), SamplerParams
        )
        == SamplerParams()
    )


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"n": 0}, "n must be in [1, 64]"),
        ({"temperature": -1.0}, "temperature must be finite and >= 0"),
        ({"temperature": float("inf")}, "temperature must be finite"),
        ({"temperature": float("nan")}, "temperature must be finite"),
        ({"top_p": float("nan")}, "top_p must be in (0, 1]"),
        ({"min_p": float("nan")}, "min_p must be in [0, 1]"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be in (0, 100]"),
        ({"repetition_penalty": 1e30}, "repetition_penalty must be in (0, 100]"),
        ({"presence_penalty": float("nan")}, "presence_penalty must be in [-2, 2]"),
        ({"logit_bias": {3: float("nan")}}, "logit_bias values must be finite"),
        ({"logit_bias": {3: float("-inf")}}, "logit_bias values must be finite"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_k": -2}, "top_k must be -1 (disabled)"),
        ({"min_p": 1.5}, "min_p must be in [0, 1]"),
        ({"presence_penalty": 3.0}, "presence_penalty must be in [-2, 2]"),
        ({"frequency_penalty": -3.0}, "frequency_penalty must be in [-2, 2]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be in (0, 100]"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"logprobs": 21}, "logprobs must be in [0, 20]"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be in [0, 20]"),
        ({"stop_token_ids": (100,)}, "stop_token_ids[0] = 100 is outside"),
        ({"allowed_token_ids": (1, -1)}, "allowed_token_ids[1] = -1"),
        ({"logit_bias": {3: 1.0, 200: 1.0}}, "logit_bias keys[1] = 200"),
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens (9) must not exceed"),
        ({"n": 2, "temperature": 0.0}, "identical"),
        ({"stop": ("",)}, "stop[0] must have 1..256 characters"),
        ({"stop": tuple(str(i) for i in range(33))}, "at most 32 are allowed"),
    ],
)
def test_out_of_range_values_say_what_to_change(changes: dict[str, object], needle: str) -> None:
    with pytest.raises(InvalidSamplingParams) as err:
        sampling_rules.validate(dataclasses.replace(SamplingParams(), **changes), LIMITS)
    assert needle in str(err.value)


def test_the_same_rules_guard_the_sampler_params() -> None:
    sampling_rules.validate(SamplerParams(), LIMITS)
    with pytest.raises(InvalidSamplingParams, match="top_p"):
        sampling_rules.validate(SamplerParams(top_p=1.5), LIMITS)
    with pytest.raises(InvalidSamplingParams, match="logit_bias"):
        sampling_rules.validate(SamplerParams(logit_bias={100: 1.0}), LIMITS)


def test_every_rule_names_a_field_of_the_contract() -> None:
    names = {f.name for f in types_pb2.SamplingParams.DESCRIPTOR.fields}
    assert set(sampling_rules.RULES) <= names
    assert set(sampling_rules.TOKEN_ID_FIELDS) <= names


def test_errors_name_their_field() -> None:
    with pytest.raises(InvalidSamplingParams) as err:
        sampling_rules.validate(SamplingParams(top_p=2.0), LIMITS)
    assert err.value.field == "top_p"


def test_child_seeds_wrap_instead_of_overflowing() -> None:
    top = 2**63 - 1
    assert sampling_rules.child_seed(top, 0) == top
    assert sampling_rules.child_seed(top, 1) == -(2**63)
    assert sampling_rules.child_seed(None, 3) is None and sampling_rules.child_seed(5, 2) == 7


def test_top_k_above_the_vocabulary_is_clamped() -> None:
    assert sampling_rules.clamp_top_k(SamplingParams(top_k=5000), 100).top_k == 100
    assert sampling_rules.clamp_top_k(SamplingParams(top_k=50), 100).top_k == 50


def test_normalize_follows_vllm() -> None:
    greedy = sampling_rules.normalize(
        SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2, logit_bias={1: 500.0})
    )
    assert (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, 0, 0.0)
    assert greedy.logit_bias == {1: 100.0}
    assert sampling_rules.normalize(SamplingParams(top_k=-1)).top_k == 0


INT_FIELDS = [f.name for f in dataclasses.fields(SamplingParams) if f.type in ("int", "int | None")]


@pytest.mark.parametrize("name", INT_FIELDS)
@pytest.mark.parametrize("value", [-(2**70), -(2**63) - 1, -1, 2**31, 2**32, 2**63, 2**70])
def test_whatever_the_validator_accepts_fits_the_wire(name: str, value: int) -> None:
    """HTTP clients send any JSON integer: validation must refuse what the contract's field
    cannot hold, so conversion never fails inside the server."""
    params = SamplingParams(**{name: value})
    try:
        sampling_rules.validate(params, LIMITS)
    except InvalidSamplingParams:
        return
    sampling_convert.to_proto(params, types_pb2.SamplingParams())

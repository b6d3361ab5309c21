"""The public API under bad input (tests/reliability/public_cases.py), over real processes on
loopback: each refusal gets its status, a message saying what to change and google.rpc details;
each accepted edge is served; after every case the stack still serves and nothing leaked. The
OpenAI HTTP API's table is test_http_bad_input.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc
from tests.e2e.client import join
from tests.e2e.stack import Stack
from tests.reliability.probes import (
    assert_proper_status,
    assert_serving_and_idle,
    call_error,
    rich_status,
)
from tests.reliability.public_cases import (
    ACCEPTED,
    INVALID,
    MAX_MODEL_LEN,
    NOT_FOUND,
    REFUSED,
    VOCAB_SIZE,
    Case,
    gen,
    with_fields,
)

pytestmark = pytest.mark.slow
SERVICE = "/splitserve.frontend.v1.GenerationService/"
MAX_STATUS_MESSAGE_CHARS = 2048
"""No refusal echoes a client's huge input back (a 1 MB id once came back in every chunk)."""
FINISHED = (types_pb2.FINISH_REASON_STOP, types_pb2.FINISH_REASON_LENGTH)
REASONS = {INVALID: "INVALID_REQUEST", NOT_FOUND: "MODEL_NOT_FOUND"}


@pytest.fixture(scope="module")
def channel(shared_stack: Stack) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(shared_stack.frontend) as ch:
        info = gen_grpc.GenerationServiceStub(ch).GetModelInfo(
            gen_pb2.GetModelInfoRequest(), timeout=30
        )
        assert (info.vocab_size, info.max_model_len) == (VOCAB_SIZE, MAX_MODEL_LEN)
        yield ch


def invoke(channel: grpc.Channel, rpc: str, request: Any) -> Any:
    """Call `rpc` with a message or raw bytes; a stream's replies are all read."""
    payload = request if isinstance(request, bytes) else request.SerializeToString()
    if rpc == "Generate":
        replies = channel.unary_stream(SERVICE + rpc)(payload, timeout=60)
        return [gen_pb2.GenerateResponse.FromString(r) for r in replies]
    return channel.unary_unary(SERVICE + rpc)(payload, timeout=60)


def test_the_table_has_the_cases_the_issue_asks_for() -> None:
    assert len(REFUSED) >= 80 and len({c.id for c in REFUSED}) == len(REFUSED)
    assert {c.rpc for c in REFUSED} == {"Generate", "Tokenize", "Detokenize", "GetModelInfo"}


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: c.id)
def test_bad_input_is_refused_and_the_engine_keeps_serving(
    shared_stack: Stack, channel: grpc.Channel, case: Case
) -> None:
    err = call_error(lambda: invoke(channel, case.rpc, case.request))
    assert err is not None, f"{case.id} was served"
    status = rich_status(err)
    assert status.code == case.code, status.message
    assert case.fragment in status.message, status.message
    assert len(status.message) <= MAX_STATUS_MESSAGE_CHARS
    assert_proper_status(err)
    if case.code in REASONS and "malformed" not in case.fragment:
        assert status.reason == REASONS[case.code]
    if case.field:
        assert status.fields == [case.field]
    assert_serving_and_idle(shared_stack)


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_edges_vllm_accepts_are_served(
    shared_stack: Stack, channel: grpc.Channel, name: str
) -> None:
    request = ACCEPTED[name]
    completions = join(invoke(channel, "Generate", request))
    assert sorted(completions) == list(range(request.sampling_params.n or 1))
    for completion in completions.values():
        assert completion.finish_reason in FINISHED and completion.token_ids
    assert_serving_and_idle(shared_stack)


def test_seed_minus_one_is_a_seed_not_unset(channel: grpc.Channel) -> None:
    def tokens(seed: int) -> list[int]:
        request = gen(seed=seed, temperature=1.0, max_tokens=16, ignore_eos=True)
        return join(invoke(channel, "Generate", request))[0].token_ids

    assert tokens(-1) == tokens(-1)
    assert tokens(-1) != tokens(-2)


def test_allowed_token_ids_and_the_request_id_are_honoured(channel: grpc.Channel) -> None:
    request = with_fields(gen(allowed_token_ids=[42], max_tokens=3, ignore_eos=True))
    request.request_id = "r" * 256
    replies = invoke(channel, "Generate", request)
    assert {r.request_id for r in replies} == {"r" * 256}
    assert join(replies)[0].token_ids == [42, 42, 42]


def test_get_model_info_ignores_unknown_fields(channel: grpc.Channel) -> None:
    unknown_field = b"\xf8\x07\x01"  # field 127, varint 1: from a newer client
    info = gen_pb2.GetModelInfoResponse.FromString(invoke(channel, "GetModelInfo", unknown_field))
    assert info.served_model_name and info.model_path == ""

"""Property-based fuzzing over real processes on loopback: GenerateRequests drawn from the
contract's descriptors (every field, out-of-range values included), and raw random bytes sent as
the request of every method of the frontend, the engine core and a worker rank. Every reply is
a proper status (never UNKNOWN, never a Python exception's text), no service dies, and the
stack still serves with nothing leaked. Seeded (derandomize) so CI is reproducible."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.core.v1 import core_service_pb2 as core_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc
from splitserve_contracts.worker.v1 import worker_service_pb2 as worker_pb2
from tests.e2e.client import join
from tests.e2e.stack import Stack
from tests.reliability.probes import assert_proper_status, assert_serving_and_idle, call_error
from tests.reliability.proto_strategies import messages, payloads

pytestmark = pytest.mark.slow
FUZZ = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
FINISHED = (types_pb2.FINISH_REASON_STOP, types_pb2.FINISH_REASON_LENGTH)
SAMPLING = types_pb2.SamplingParams.DESCRIPTOR
MAX_TOKENS = st.integers(1, 6) | st.sampled_from([0, 2048, 2**32 - 1])
"""Always set, and short when valid: an unset max_tokens would run to max_model_len."""
SAMPLING_OVERRIDES = {SAMPLING.fields_by_name["max_tokens"].full_name: MAX_TOKENS}
GENERATE_OVERRIDES = {
    "splitserve.frontend.v1.GenerateRequest.sampling_params": messages(
        SAMPLING, SAMPLING_OVERRIDES
    ),
    # Mostly what a client sends, so that most requests reach the engine; the refusals of
    # these fields have their own cases (test_public_bad_input.py).
    "splitserve.frontend.v1.GenerateRequest.model": st.sampled_from(["", "tiny-llama-v1"]),
    "splitserve.frontend.v1.GenerateRequest.prompt": st.text(min_size=1, max_size=40),
    "splitserve.frontend.v1.TokenIds.ids": st.lists(st.integers(0, 2100), min_size=1, max_size=40),
    "splitserve.frontend.v1.Chat.messages": st.lists(
        messages(gen_pb2.ChatMessage.DESCRIPTOR), min_size=1, max_size=3
    ),
    "splitserve.frontend.v1.GenerateRequest.request_id": st.text(max_size=12),
    "splitserve.frontend.v1.GenerateRequest.cache_salt": st.text(max_size=12),
}
GENERATE_REQUESTS = messages(gen_pb2.GenerateRequest.DESCRIPTOR, GENERATE_OVERRIDES)


@pytest.fixture(scope="module")
def frontend(shared_stack: Stack) -> Iterator[gen_grpc.GenerationServiceStub]:
    with grpc.insecure_channel(shared_stack.frontend) as channel:
        yield gen_grpc.GenerationServiceStub(channel)


def assert_all_alive(stack: Stack) -> None:
    for child in stack.children:
        assert child.process.poll() is None, f"{child.name} died"


@FUZZ
@given(request=GENERATE_REQUESTS)
def test_generated_requests_get_a_stream_or_a_refusal(
    shared_stack: Stack, frontend: gen_grpc.GenerationServiceStub, request: gen_pb2.GenerateRequest
) -> None:
    replies: list[gen_pb2.GenerateResponse] = []
    err = call_error(lambda: replies.extend(frontend.Generate(request, timeout=120)))
    if err is not None:
        assert_proper_status(err)
        assert err.code() in REFUSALS, (err.code(), err.details())
    else:
        completions = join(replies)
        assert len(completions) == max(request.sampling_params.n, 1)
        assert all(c.finish_reason in FINISHED for c in completions.values())
    assert_serving_and_idle(shared_stack)


def _methods() -> list[tuple[str, MethodDescriptor]]:
    services = [
        ("frontend", gen_pb2.DESCRIPTOR.services_by_name["GenerationService"]),
        ("core", core_pb2.DESCRIPTOR.services_by_name["EngineCoreService"]),
        ("worker", worker_pb2.DESCRIPTOR.services_by_name["WorkerService"]),
    ]
    return [(kind, method) for kind, service in services for method in service.methods]


METHODS = _methods()
ONE_TOKEN = b"\x2a\x02\x68\x01"
"""sampling_params {max_tokens: 1}, appended to Generate's bytes (protobuf merges a repeated
message field): a random prompt that parses is served in one step, not to max_model_len."""


RAW_OVERRIDES = {
    **SAMPLING_OVERRIDES,
    "splitserve.worker.v1.LoadModelRequest.owner_epoch": st.just(0),
    "splitserve.core.v1.EngineCoreRequest.max_tokens": MAX_TOKENS,
}
"""Valid messages stay cheap (short generations) and never take a rank over."""


def _address(stack: Stack, kind: str) -> str:
    return {"frontend": stack.frontend, "core": stack.core, "worker": stack.worker}[kind]


def _is_takeover(payload: bytes) -> bool:
    """A LoadModel that parses with an epoch: a core taking the rank over, which plaintext
    allows on purpose (tests/security covers who may, under mutual TLS)."""
    try:
        return worker_pb2.LoadModelRequest.FromString(payload).owner_epoch > 0
    except Exception:  # noqa: BLE001 (malformed bytes: the case this test wants)
        return False


def invoke_raw(channel: grpc.Channel, method: MethodDescriptor, payload: bytes) -> Any:
    path = f"/{method.containing_service.full_name}/{method.name}"
    if method.client_streaming:
        return list(channel.stream_stream(path)(iter([payload]), timeout=60))
    if method.server_streaming:
        return list(channel.unary_stream(path)(payload, timeout=60))
    return channel.unary_unary(path)(payload, timeout=60)


@pytest.mark.parametrize(("kind", "method"), METHODS, ids=lambda m: getattr(m, "name", m))
def test_random_bytes_get_a_proper_status_on_every_method(
    shared_stack: Stack, kind: str, method: MethodDescriptor
) -> None:
    with grpc.insecure_channel(_address(shared_stack, kind)) as channel:

        @settings(FUZZ, max_examples=30)
        @given(payload=payloads(method.input_type, RAW_OVERRIDES))
        def replies_are_proper(payload: bytes) -> None:
            if method.name == "LoadModel":
                assume(not _is_takeover(payload))
            if method.name == "Generate":
                payload += ONE_TOKEN
            err = call_error(lambda: invoke_raw(channel, method, payload))
            if err is not None:
                assert_proper_status(err)
            assert_all_alive(shared_stack)

        replies_are_proper()
    assert_serving_and_idle(shared_stack)

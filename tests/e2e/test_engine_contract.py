"""The gateway contract (smg-grpc-proto's VllmEngine) on a real frontend: the same generation
as the public API, structured outputs from the request's `constraint`, the same validation,
refusals by name for what the engine cannot do yet, Abort and FlushCache on the engine core,
GetTokenizer's archive, events off by default."""

from __future__ import annotations

import hashlib
import io
import json
import re
import zipfile
from typing import Any

import grpc
import jsonschema
import pytest
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import common_pb2

from splitserve.children import stop_children
from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
from tests.e2e.client import generate
from tests.e2e.gateway_stack import Engine, is_idle, wait_for
from tests.e2e.stack import Stack
from tests.reliability.probes import assert_proper_status, rich_status

pytestmark = pytest.mark.slow
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
PROMPT = list(range(40, 90))


@pytest.fixture(scope="module")
def engine(gateway_engines: list[Engine]) -> Engine:
    return gateway_engines[0]


def tokenized(request_id: str, stream: bool = True, **params: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        tokenized=pb.TokenizedInput(input_ids=PROMPT),
        sampling_params=pb.SamplingParams(**params),
        stream=stream,
    )


def test_generate_streams_what_the_public_api_generates(engine: Engine) -> None:
    expected = generate(
        engine.stack.frontend,
        gen_pb2.GenerateRequest(
            prompt_token_ids=gen_pb2.TokenIds(ids=PROMPT),
            sampling_params=types_pb2.SamplingParams(
                temperature=0.0, max_tokens=12, ignore_eos=True
            ),
        ),
    )[0]
    stub = engine.stub()
    params = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    streamed = list(stub.Generate(tokenized("c-stream", **params), timeout=60))
    assert all(r.WhichOneof("response") == "chunk" for r in streamed[:-1])
    chunks = [t for r in streamed[:-1] for t in r.chunk.token_ids]
    complete = streamed[-1].complete
    assert chunks == expected.token_ids and complete.finish_reason == "length"
    assert (complete.prompt_tokens, complete.completion_tokens) == (len(PROMPT), 12)
    (whole,) = stub.Generate(tokenized("c-whole", stream=False, **params), timeout=60)
    assert list(whole.complete.output_ids) == expected.token_ids
    sampled = {"temperature": 1.0, "seed": 7, "max_tokens": 12, "ignore_eos": True}
    n2 = list(stub.Generate(tokenized("c-n2", n=2, stream=False, **sampled), timeout=60))
    assert sorted(r.complete.index for r in n2) == [0, 1]
    assert all(len(r.complete.output_ids) == r.complete.completion_tokens == 12 for r in n2)


SCHEMA = {
    "type": "object",
    "properties": {
        "word": {"type": "string", "maxLength": 8},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["word", "count"],
    "additionalProperties": False,
}
TAG = {
    "structures": [{"begin": "<function=size>", "schema": SCHEMA, "end": "</function>"}],
    "triggers": ["<function="],
}
"""vLLM's structural-tag form of a tool call (free text until the trigger)."""


def _json(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


def _json_object(text: str) -> None:
    assert isinstance(json.loads(text), dict), text


def _tagged(text: str) -> None:
    """Free text, then each tagged structure holds what its schema allows."""
    for value in re.findall(r"<function=size>(.*?)</function>", text, re.DOTALL):
        _json(value)


CHOICES = ["red sky", "blue", "green"]
CONSTRAINTS = {
    "json_schema": (json.dumps(SCHEMA), _json),
    "regex": (r"[a-c]{2,5}-\d{1,3}", r"[a-c]{2,5}-\d{1,3}"),
    "choice": (pb.ChoiceConstraint(choices=CHOICES), CHOICES),
    "grammar": ('root ::= "(" [0-9]{1,3} ("," [0-9]{1,3}){0,2} ")"', r"\(\d{1,3}(,\d{1,3}){0,2}\)"),
    "json_object": (True, _json_object),
    "structural_tag": (json.dumps(TAG), _tagged),
}
"""Each kind of the `constraint` oneof -> (its value, what the text must be: a pattern it fully
matches, one of a list, or a check)."""


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_the_constraint_shapes_what_generate_returns(
    engine: Engine, tokenizer: Any, kind: str
) -> None:
    """Each kind of the request's `constraint` oneof, at temperature 1.0 on random weights: the
    completion's token ids decode to text the constraint allows, and a finished grammar stops
    the request (vLLM's servicer maps the oneof onto StructuredOutputsParams the same way).
    A structural tag allows free text, so only its tagged parts are checked."""
    value, expected = CONSTRAINTS[kind]
    stub = engine.stub()
    for seed in range(2):
        params = {"temperature": 1.0, "seed": seed, "max_tokens": 200, kind: value}
        request = tokenized(f"c-{kind}-{seed}", stream=seed == 0, **params)
        responses = list(stub.Generate(request, timeout=120))
        complete = responses[-1].complete  # streamed: the chunks hold every token (vLLM's)
        ids = [t for r in responses[:-1] for t in r.chunk.token_ids] or list(complete.output_ids)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if isinstance(expected, str):
            assert re.fullmatch(expected, text), (kind, text)
        elif isinstance(expected, list):
            assert text in expected, (kind, text)
        else:
            expected(text)
        assert kind == "structural_tag" or complete.finish_reason == "stop", (kind, text)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (
            {"sampling_params": pb.SamplingParams(json_schema='{"type": "nope"}')},
            "sampling_params.json_schema",
        ),
        ({"sampling_params": pb.SamplingParams(regex="(unclosed")}, "sampling_params.regex"),
        (
            {"sampling_params": pb.SamplingParams(choice=pb.ChoiceConstraint())},
            "sampling_params.choice",
        ),
        ({"sampling_params": pb.SamplingParams(json_object=False)}, "sampling_params.json_object"),
        ({"kv_transfer_params_json": "{}"}, "kv_transfer_params_json"),
        ({"mm_inputs": pb.MultimodalInputs(im_token_id=5)}, "mm_inputs"),
        ({"data_parallel_rank": 3}, "data_parallel_rank"),
        ({"tokenized": pb.TokenizedInput(input_ids=[5, 1 << 30])}, "prompt_token_ids"),
        ({"sampling_params": pb.SamplingParams(temperature=-1.0)}, "sampling_params.temperature"),
        ({"sampling_params": pb.SamplingParams(max_tokens=1 << 20)}, "sampling_params.max_tokens"),
        (
            {"sampling_params": pb.SamplingParams(truncate_prompt_tokens=0)},
            "sampling_params.truncate_prompt_tokens",
        ),
        ({"request_id": "r" * 300}, "request_id"),
    ],
)
def test_what_the_engine_cannot_do_is_refused_by_name(
    engine: Engine, change: dict[str, Any], field: str
) -> None:
    request = tokenized("refused", max_tokens=4)
    for name, value in change.items():
        if isinstance(value, (str, int)):
            setattr(request, name, value)
        else:
            getattr(request, name).CopyFrom(value)
    with pytest.raises(grpc.RpcError) as info:
        list(engine.stub().Generate(request, timeout=30))
    status = rich_status(info.value)
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT and status.reason == "INVALID_REQUEST"
    assert status.fields == [field], status.message


def test_unimplemented_calls_say_so(engine: Engine, stack: Stack) -> None:
    stub = engine.stub()
    calls = [
        lambda: stub.Embed(pb.EmbedRequest(request_id="e"), timeout=10),
        lambda: stub.StartProfile(common_pb2.StartProfileRequest(), timeout=10),
        lambda: stub.StopProfile(common_pb2.StopProfileRequest(), timeout=10),
        # the session stack runs without --kv-events-config: no events to serve
        lambda: next(
            pb_grpc.VllmEngineStub(grpc.insecure_channel(stack.frontend)).SubscribeKvEvents(
                common_pb2.SubscribeKvEventsRequest(), timeout=10
            )
        ),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED and info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        next(stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=7)))
    assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE


def test_abort_ends_the_stream_and_a_flush_waits_for_free_blocks(engine: Engine) -> None:
    """FlushCache is refused while a request holds KV blocks (vLLM's rule); Abort by request id
    ends its stream with finish_reason abort and frees them; then the flush succeeds."""
    stub = engine.stub()
    stream = stub.Generate(tokenized("long", max_tokens=400, ignore_eos=True), timeout=60)
    first = next(stream)
    assert first.WhichOneof("response") == "chunk"
    refused = stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=0), timeout=30)
    assert not refused.success and "hold" in refused.message
    stub.Abort(pb.AbortRequest(request_ids=["long", "unknown-id"]), timeout=10)
    rest = list(stream)
    assert rest[-1].complete.finish_reason == "abort"
    assert sum(len(r.chunk.token_ids) for r in rest) < 399
    flushed = stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=10), timeout=30)
    assert flushed.success, flushed.message
    wait_for(lambda: is_idle(engine) and engine.stack.scheduler_stats().num_used_blocks == 0)
    with pytest.raises(grpc.RpcError) as info:
        stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=float("nan")), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_model_server_loads_and_tokenizer_facts(engine: Engine, tokenizer: Any) -> None:
    stub = engine.stub()
    model = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert model.max_context_length == 512 and model.vocab_size == 2048
    assert list(model.eos_token_ids) == [tokenizer.eos_token_id] and not model.supports_vision
    assert model.tokenizer_path == "" and model.model_type == "llama"
    server = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert (server.server_type, server.block_size, server.data_parallel_size) == (
        "vllm-grpc",
        16,
        1,
    )
    (load,) = stub.GetLoads(pb.GetLoadsRequest(), timeout=10).loads
    assert load.max_total_num_tokens == 47 * 16 and load.max_running_requests == 256
    assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy
    chunks = list(stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=30))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert all(not c.sha256 for c in chunks[:-1])
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = set(archive.namelist())
        assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= names
        config = json.loads(archive.read("tokenizer_config.json"))
    assert config["eos_token"] == tokenizer.eos_token


def test_the_api_key_guards_the_gateway_contract_too(stack: Stack) -> None:
    child = stack.add_frontend(api_key="s3cret")
    try:
        with grpc.insecure_channel(child.address) as channel:
            stub = pb_grpc.VllmEngineStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            key = (("authorization", "Bearer s3cret"),)
            assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10, metadata=key).vocab_size
    finally:
        stop_children([child])


@pytest.mark.parametrize(
    "method", ["Generate", "Abort", "GetLoads", "FlushCache", "SubscribeKvEvents", "GetTokenizer"]
)
def test_malformed_messages_are_refused_and_the_engine_keeps_serving(
    engine: Engine, method: str
) -> None:
    streams = method in ("Generate", "SubscribeKvEvents", "GetTokenizer")
    with grpc.insecure_channel(engine.stack.frontend) as channel:
        path = f"/{SERVICE_NAME}/{method}"
        call = channel.unary_stream(path) if streams else channel.unary_unary(path)
        with pytest.raises(grpc.RpcError) as info:
            reply = call(b"\x0a\x05ab", timeout=10)
            if streams:
                list(reply)
    assert_proper_status(info.value)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed" in (info.value.details() or "")
    assert engine.stub().HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy

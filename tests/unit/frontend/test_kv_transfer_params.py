"""vLLM's kv_transfer_params on the frontend (P/D): refused by name without a KV connector; with
one, the gateway's kv_transfer_params_json (a JSON object, <= 64 KiB, n = 1) and the HTTP body's
kv_transfer_params reach the engine core's request, and a finished request's handoff comes back
in GenerateComplete.kv_transfer_params_json and the response's `kv_transfer_params`; the engine
series count a connector's external prefix-cache hits (vLLM's names)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from smg_grpc_proto import vllm_engine_pb2 as pb

from frontend_svc.engine import core_convert
from frontend_svc.engine.detokenizer import backend_decoder
from frontend_svc.engine.engine_stats import EngineSeries
from frontend_svc.engine.engine_types import (
    CoreOutputDetail,
    CoreOutputs,
    EngineInfo,
    EngineSnapshot,
)
from frontend_svc.engine.output_processor import OutputProcessor
from frontend_svc.errors import InvalidRequest
from frontend_svc.gateway import convert, kv_params
from frontend_svc.gateway.servicer import VllmEngineServicer
from frontend_svc.inputs.input_processor import InputProcessor
from frontend_svc.kv_transfer import MAX_PARAMS_BYTES, has_kv_connector
from frontend_svc.openai.generation import ServingContext
from frontend_svc.openai.protocol import RequestLimits, parse_chat, parse_completion
from frontend_svc.openai.serving_completion import CompletionRun
from frontend_svc.requests import CompletionDelta, EngineRequest
from splitserve_contracts.core.v1 import core_service_pb2 as core_pb2
from splitserve_contracts.engine_options_types import KVTransferOptions
from splitserve_contracts.output_types import FinishReason, SchedulerStats
from splitserve_contracts.sampling_rules import Limits
from splitserve_contracts.sampling_types import SamplingParams
from splitserve_runtime.engine_option_rules import engine_options
from tests.unit.frontend.test_output_processor import metrics

PLAIN = EngineInfo("m", 512, 2048, 101, "float32", True, "0", 3.0, engine_options())
PRODUCER = dataclasses.replace(
    PLAIN,
    options=dataclasses.replace(
        PLAIN.options,
        kv_transfer=KVTransferOptions("GrpcConnector", "kv_producer", kv_engine_id="prefill-0"),
    ),
)
HANDOFF = {"do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_block_ids": [3]}
HANDOFF_JSON = json.dumps(HANDOFF)


def _request(**fields: Any) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(request_id="r", tokenized=pb.TokenizedInput(input_ids=[5, 6, 7]))
    msg.sampling_params.max_tokens = 1
    for name, value in fields.items():
        if isinstance(value, str):
            setattr(msg, name, value)
        else:
            getattr(msg, name).CopyFrom(value)
    return msg


def _refused(msg: pb.GenerateRequest, has_connector: bool) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        kv_params.kv_transfer_params_json(msg, has_connector)
    return info.value


def test_without_a_connector_both_fields_stay_refused_by_name() -> None:
    assert not has_kv_connector(PLAIN) and has_kv_connector(PRODUCER)
    typed = pb.KvTransferParams(remote_host="h", remote_port=1)
    for name, value in (("kv_transfer_params_json", "{}"), ("kv_transfer_params", typed)):
        err = _refused(_request(**{name: value}), has_connector=False)
        assert err.param == name and "without a KV connector" in str(err)
    assert kv_params.kv_transfer_params_json(_request(), has_kv_connector=False) == ""


def test_with_a_connector_the_json_object_passes_verbatim() -> None:
    msg = _request(kv_transfer_params_json=HANDOFF_JSON)
    assert kv_params.kv_transfer_params_json(msg, has_kv_connector=True) == HANDOFF_JSON
    assert kv_params.kv_transfer_params_json(_request(), has_kv_connector=True) == ""


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("[1]", "must be a JSON object, got list"),
        ("nope", "is not valid JSON"),
        ('"s"', "must be a JSON object, got str"),
        (json.dumps({"k": "x" * MAX_PARAMS_BYTES}), f"at most {MAX_PARAMS_BYTES}"),
    ],
)
def test_a_bad_json_is_refused_naming_the_field(text: str, said: str) -> None:
    err = _refused(_request(kv_transfer_params_json=text), has_connector=True)
    assert err.param == "kv_transfer_params_json" and said in str(err)


def test_the_typed_params_say_to_use_the_json_field() -> None:
    typed = pb.KvTransferParams(remote_host="h", remote_port=1)
    err = _refused(_request(kv_transfer_params=typed), has_connector=True)
    assert err.param == "kv_transfer_params" and "kv_transfer_params_json" in str(err)


def test_one_handoff_is_not_fanned_out_to_n_children() -> None:
    msg = _request(kv_transfer_params_json=HANDOFF_JSON)
    msg.sampling_params.n = 2
    err = _refused(msg, has_connector=True)
    assert err.param == "kv_transfer_params_json" and "n = 1" in str(err)


def test_server_info_advertises_the_connector() -> None:
    info = convert.server_info_to_proto(PRODUCER, 0, False, 0.0, 1.0, 1)
    assert (info.kv_connector, info.kv_role, info.kv_engine_id) == (
        "GrpcConnector",
        "kv_producer",
        "prefill-0",
    )
    plain = convert.server_info_to_proto(PLAIN, 0, False, 0.0, 1.0, 1)
    assert (plain.kv_connector, plain.kv_role, plain.kv_engine_id) == ("", "", "")


def test_the_core_request_and_output_carry_the_json() -> None:
    req = EngineRequest("r", [1, 2], dataclasses.replace(_params(), max_tokens=1), None)
    req = dataclasses.replace(req, kv_transfer_params_json=HANDOFF_JSON)
    assert core_convert.engine_request_to_proto(1, req).kv_transfer_params_json == HANDOFF_JSON
    out = core_pb2.EngineCoreOutputs(request_handles=[1], num_new_tokens=[0])
    out.details.add(request_handle=1, finish_reason=2, kv_transfer_params_json=HANDOFF_JSON)
    detail = core_convert.core_outputs_from_proto(out).details[1]
    assert detail.kv_transfer_params_json == HANDOFF_JSON


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=1)


def test_the_final_delta_carries_the_handoff(tokenizer: Any) -> None:
    proc = OutputProcessor(backend_decoder(tokenizer), metrics())
    queue: asyncio.Queue[Any] = asyncio.Queue()
    proc.add_request(4, 0, _params(), 3, queue)
    detail = CoreOutputDetail(4, FinishReason.LENGTH, kv_transfer_params_json=HANDOFF_JSON)
    proc.process_outputs(CoreOutputs([4], [1], [5], {4: detail}, 0.0, 1))
    deltas = [queue.get_nowait() for _ in range(queue.qsize())]
    assert deltas[-1].is_finished and deltas[-1].kv_transfer_params_json == HANDOFF_JSON


class HandoffEngine:
    """Finishes every request after one token with HANDOFF; keeps what it was sent."""

    is_ready = True
    scheduler_stats = None

    def __init__(self) -> None:
        self.requests: list[EngineRequest] = []

    async def generate(
        self, request: EngineRequest, *_: Any, **__: Any
    ) -> AsyncIterator[CompletionDelta]:
        self.requests.append(request)
        yield CompletionDelta(0, [9], "x", len(request.prompt_token_ids), 1, 0,
                              FinishReason.LENGTH, kv_transfer_params_json=HANDOFF_JSON)  # fmt: skip


class Refused(Exception):
    pass


class Context:
    def invocation_metadata(self) -> tuple[()]:
        return ()

    async def abort_with_status(self, status: grpc.Status) -> None:
        raise Refused(status)


def _servicer(info: EngineInfo, tokenizer: Any) -> tuple[VllmEngineServicer, HandoffEngine]:
    engine = HandoffEngine()
    inputs = InputProcessor(tokenizer, info.max_model_len, Limits(info.vocab_size))
    files: Any = SimpleNamespace(tokenizer=tokenizer, tokenizer_folder=None)
    servicer = VllmEngineServicer(
        engine,  # type: ignore[arg-type]
        inputs, info, files, "m", None, None,  # type: ignore[arg-type]
    )  # fmt: skip
    return servicer, engine


async def _generate(servicer: VllmEngineServicer, msg: pb.GenerateRequest) -> list[Any]:
    return [r async for r in servicer.Generate(msg, Context())]  # type: ignore[arg-type]


def test_generate_passes_the_handoff_both_ways(tokenizer: Any) -> None:
    servicer, engine = _servicer(PRODUCER, tokenizer)
    replies = asyncio.run(_generate(servicer, _request(kv_transfer_params_json='{"a": 1}')))
    assert engine.requests[0].kv_transfer_params_json == '{"a": 1}'
    assert replies[-1].complete.kv_transfer_params_json == HANDOFF_JSON
    plain, _ = _servicer(PLAIN, tokenizer)
    with pytest.raises(Refused) as info:
        asyncio.run(_generate(plain, _request(kv_transfer_params_json="{}")))
    status = info.value.args[0]
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "kv_transfer_params_json" in status.details


LIMITS = RequestLimits(Limits(101))
WITH_CONNECTOR = RequestLimits(Limits(101), has_kv_connector=True)
MESSAGES = [{"role": "user", "content": "hi"}]


def test_http_kv_transfer_params_need_a_connector() -> None:
    for parse, body in ((parse_completion, {"prompt": "x"}), (parse_chat, {"messages": MESSAGES})):
        with pytest.raises(InvalidRequest, match="not supported") as info:
            parse(body | {"kv_transfer_params": HANDOFF}, LIMITS)
        assert info.value.param == "kv_transfer_params"
        req = parse(body | {"kv_transfer_params": HANDOFF}, WITH_CONNECTOR)
        assert json.loads(req.kv_transfer_params_json) == HANDOFF
        assert parse(body, WITH_CONNECTOR).kv_transfer_params_json == ""


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ({"prompt": "x", "kv_transfer_params": [1]}, "must be an object"),
        ({"prompt": ["x", "y"], "kv_transfer_params": HANDOFF}, "2 engine requests"),
        ({"prompt": "x", "n": 2, "kv_transfer_params": HANDOFF}, "n > 1"),
    ],
)
def test_http_params_are_one_object_for_one_request(body: dict[str, Any], said: str) -> None:
    with pytest.raises(InvalidRequest, match=said) as info:
        parse_completion(body, WITH_CONNECTOR)
    assert info.value.param == "kv_transfer_params"


def test_the_completion_response_carries_the_handoff(tokenizer: Any) -> None:
    engine = HandoffEngine()
    inputs = InputProcessor(tokenizer, PRODUCER.max_model_len, Limits(PRODUCER.vocab_size))
    ctx = ServingContext(engine, inputs, PRODUCER, "m", 0.0)  # type: ignore[arg-type]
    req = parse_completion(
        {"prompt": "x", "max_tokens": 1, "kv_transfer_params": {}}, ctx.request_limits
    )
    body = asyncio.run(CompletionRun(ctx, req, "cmpl-1").response())
    assert body["kv_transfer_params"] == HANDOFF
    assert engine.requests[0].kv_transfer_params_json == "{}"


def test_the_engine_series_count_external_hits_and_remote_kv_waits() -> None:
    waits = {"num_waiting_reqs": 1, "num_waiting_deferred": 1, "num_waiting_for_remote_kvs": 2}
    stats = SchedulerStats(
        **waits,
        external_prefix_cache_queries=2000,
        external_prefix_cache_hits=2001,  # a peer's hits beyond its queries: capped
        kv_transfer_received_bytes=46_000_000,
        kv_transfer_seconds=0.25,
        kv_transfer_num_loads=3,
        kv_transfer_num_failed_loads=1,
    )
    registry = CollectorRegistry()
    registry.register(EngineSeries(EngineSnapshot(stats), "m", PRODUCER))
    values = {
        (s.name, s.labels.get("reason", "")): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }
    assert values[("vllm:external_prefix_cache_queries_total", "")] == 2000
    assert values[("vllm:external_prefix_cache_hits_total", "")] == 2000
    assert values[("splitserve:kv_transfer_received_bytes_total", "")] == 46_000_000
    assert values[("splitserve:kv_transfer_seconds_total", "")] == 0.25
    assert values[("splitserve:kv_transfer_loads_total", "")] == 3
    assert values[("splitserve:kv_transfer_failed_loads_total", "")] == 1
    assert values[("vllm:num_requests_waiting", "")] == 4  # vLLM: all in its waiting queue
    assert values[("vllm:num_requests_waiting_by_reason", "deferred")] == 3
    assert values[("vllm:num_requests_waiting_by_reason", "capacity")] == 1

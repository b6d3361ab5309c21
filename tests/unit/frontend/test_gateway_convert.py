"""The gateway contract's conversions: vLLM's servicer's reading of SamplingParams and of its
structured-outputs constraint, the responses of streamed and whole generations, KV-event batches
as the gateway reads them, load rates."""

from __future__ import annotations

import dataclasses

import pytest
from google.protobuf.descriptor import FieldDescriptor
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_servicer.load_record import engine_load_from

from frontend_svc.engine.engine_types import EngineInfo
from frontend_svc.errors import InvalidRequest
from frontend_svc.gateway import convert
from frontend_svc.gateway.loads import LoadReporter
from frontend_svc.kv_events.hub import AllBlocksCleared, BlockExtraKeys, BlocksRemoved, BlocksStored
from frontend_svc.requests import CompletionDelta, Logprob, TokenLogprobs
from splitserve_contracts.output_types import FinishReason, SchedulerStats
from splitserve_contracts.sampling_types import SamplingParams
from splitserve_contracts.structured_outputs import StructuredOutputsParams
from splitserve_runtime.engine_option_rules import engine_options, replace_options

INFO = EngineInfo(
    "m",
    512,
    2048,
    101,
    "float32",
    True,
    "0",
    3.0,
    engine_options(max_num_seqs=64, max_num_batched_tokens=2048),
)


def test_unset_and_zero_fields_read_as_vllms_servicer_reads_them() -> None:
    params = convert.sampling_params_from_proto(pb.SamplingParams())
    assert params == SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)
    assert (params.n, params.temperature, params.top_p, params.repetition_penalty) == (1, 1, 1, 1)
    explicit = convert.sampling_params_from_proto(
        pb.SamplingParams(temperature=0.0, top_p=0.5, max_tokens=7, seed=3, logprobs=0, n=2)
    )
    assert (explicit.temperature, explicit.top_p, explicit.max_tokens) == (0.0, 0.5, 7)
    assert (explicit.seed, explicit.logprobs, explicit.n) == (3, 0, 2)


def test_every_field_of_smgs_sampling_params_is_copied_or_listed() -> None:
    """An smg-grpc-proto upgrade whose SamplingParams gains a field fails here until the field
    is one of our record's (copied by name) or listed, with why, in NOT_COPIED."""
    names = {f.name for f in pb.SamplingParams.DESCRIPTOR.fields}
    copied = {f.name for f in convert.COPIED}
    assert copied | set(convert.NOT_COPIED) == names
    assert not copied & set(convert.NOT_COPIED)
    assert set(convert.VLLM_DEFAULTS) <= copied
    ours = {f.name for f in dataclasses.fields(SamplingParams)}
    assert copied == ours & names - set(convert.NOT_COPIED)


F = FieldDescriptor
SCALARS = {F.CPPTYPE_FLOAT: 0.25, F.CPPTYPE_DOUBLE: 0.25, F.CPPTYPE_BOOL: True, F.CPPTYPE_STRING: "x",
           F.CPPTYPE_INT32: 3, F.CPPTYPE_INT64: 3, F.CPPTYPE_UINT32: 3, F.CPPTYPE_UINT64: 3}  # fmt: skip
"""A non-default value per proto scalar type (0.25 is exact in float32)."""


def _scalar(field: FieldDescriptor) -> object:
    return SCALARS[field.cpp_type]


def _non_default(field: FieldDescriptor) -> tuple[object, object]:
    """(what to set on the message, what our record should read) for one copied field."""
    entry = field.message_type
    if entry is not None and entry.GetOptions().map_entry:
        key, value = _scalar(entry.fields_by_name["key"]), _scalar(entry.fields_by_name["value"])
        return {key: value}, {key: value}
    if field.is_repeated:
        return [_scalar(field)], (_scalar(field),)
    return _scalar(field), _scalar(field)


def test_every_shared_field_is_copied_with_its_value() -> None:
    """A message with a non-default value in every field our record shares with smg's, built
    from the descriptor: each reads back unchanged."""
    values = {f.name: _non_default(f) for f in convert.COPIED}
    msg = pb.SamplingParams(**{name: sent for name, (sent, _) in values.items()})  # type: ignore[arg-type]
    params = convert.sampling_params_from_proto(msg)
    assert {name: getattr(params, name) for name in values} == {
        name: read for name, (_, read) in values.items()
    }


def test_truncate_prompt_tokens_keeps_the_last_tokens() -> None:
    request = pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=list(range(10))),
        sampling_params=pb.SamplingParams(truncate_prompt_tokens=3),
    )
    call = convert.generate_input_from_proto(request, "r", max_model_len=512)
    assert call.prompt.token_ids == (7, 8, 9)
    with pytest.raises(InvalidRequest):
        convert.generate_input_from_proto(pb.GenerateRequest(), "r", 512)


@pytest.mark.parametrize(
    ("constraint", "expected"),
    [
        ({"json_schema": '{"type": "object"}'}, StructuredOutputsParams(json='{"type": "object"}')),
        ({"regex": "[a-z]+"}, StructuredOutputsParams(regex="[a-z]+")),
        ({"grammar": 'root ::= "x"'}, StructuredOutputsParams(grammar='root ::= "x"')),
        ({"structural_tag": '{"a": 1}'}, StructuredOutputsParams(structural_tag='{"a": 1}')),
        ({"json_object": True}, StructuredOutputsParams(json_object=True)),
        (
            {"choice": pb.ChoiceConstraint(choices=["yes", "no"])},
            StructuredOutputsParams(choice=("yes", "no")),
        ),
    ],
)
def test_each_constraint_is_one_structured_outputs_params(
    constraint: dict[str, object], expected: StructuredOutputsParams
) -> None:
    """As vLLM's servicer maps the `constraint` oneof; errors then name the request's field."""
    request = pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=[1, 2]),
        sampling_params=pb.SamplingParams(**constraint),  # type: ignore[arg-type]
    )
    call = convert.generate_input_from_proto(request, "r", 512)
    assert call.structured_outputs == expected
    assert call.structured_outputs_field == f"sampling_params.{next(iter(constraint))}"


def test_no_constraint_and_a_false_json_object() -> None:
    request = pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[1, 2]))
    assert convert.generate_input_from_proto(request, "r", 512).structured_outputs is None
    request.sampling_params.json_object = False  # set in the oneof, but asks for nothing
    with pytest.raises(InvalidRequest) as info:
        convert.generate_input_from_proto(request, "r", 512)
    assert info.value.param == "sampling_params.json_object"


def delta(index: int, tokens: list[int], finish: FinishReason = FinishReason.UNSPECIFIED,
          completion_tokens: int = 0, **more: object) -> CompletionDelta:  # fmt: skip
    return CompletionDelta(index, tokens, "", 5, completion_tokens, 2, finish, **more)  # type: ignore[arg-type]


def test_streamed_chunks_then_a_complete_per_index() -> None:
    chosen = TokenLogprobs(Logprob(9, -0.5, 1, "x"), [Logprob(8, -1.0, 2, "y")])
    builder = convert.ResponseBuilder(SamplingParams(logprobs=1), [1, 2, 3, 4, 5], stream=True)
    first = builder.responses(delta(0, [9], logprobs=[chosen]))
    (chunk,) = first
    assert list(chunk.chunk.token_ids) == [9] and chunk.chunk.completion_tokens == 1
    assert list(chunk.chunk.output_logprobs.top_logprobs[0].token_ids) == [8]
    last = builder.responses(delta(0, [1], FinishReason.STOP, completion_tokens=2, stop_token_id=1))
    assert [r.WhichOneof("response") for r in last] == ["chunk", "complete"]
    complete = last[1].complete
    assert (complete.finish_reason, complete.matched_token_id) == ("stop", 1)
    assert (complete.prompt_tokens, complete.completion_tokens, complete.cached_tokens) == (5, 2, 2)


def test_a_whole_generation_is_one_complete_with_every_token() -> None:
    builder = convert.ResponseBuilder(SamplingParams(), [1, 2], stream=False)
    assert builder.responses(delta(1, [7, 8])) == []
    (done,) = builder.responses(
        delta(1, [9], FinishReason.LENGTH, completion_tokens=3, stop_str=None)
    )
    assert list(done.complete.output_ids) == [7, 8, 9] and done.complete.index == 1
    (aborted,) = convert.ResponseBuilder(SamplingParams(), [1], False).responses(
        delta(0, [], FinishReason.ABORT)
    )
    assert aborted.complete.finish_reason == "abort"


def test_kv_batches_carry_signed_hashes_and_the_device_tier() -> None:
    events = [
        AllBlocksCleared(),
        BlocksStored([2**64 - 1, 5], 3, [1, 2, 3, 4], [BlockExtraKeys("s"), BlockExtraKeys()]),
        BlocksRemoved([2**63]),
    ]
    batch = convert.kv_batch_to_proto(events, 4, 1.5, block_size=2, first_event_id=10)
    assert batch.sequence_number == 4 and [e.event_id for e in batch.events] == [10, 11, 12]
    stored = batch.events[1].stored
    assert [b.block_hash for b in stored.blocks] == [-1, 5] and stored.parent_block_hash == 3
    assert [list(b.token_ids) for b in stored.blocks] == [[1, 2], [3, 4]]
    assert stored.cache_salt == "s" and stored.blocks[0].extra_keys[0].text == "s"
    assert stored.medium == "GPU" and stored.blocks[1].block_size == 2
    assert list(batch.events[2].removed.block_hashes) == [-(2**63)]


def test_load_rates_come_from_the_cores_cumulative_counters() -> None:
    now = [0.0]
    stats = [SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.5)]
    reporter = LoadReporter(INFO, lambda: stats[-1], clock=lambda: now[0])
    first = reporter.load()
    assert (first.gen_throughput, first.max_total_num_tokens, first.num_used_tokens) == (
        0,
        1600,
        800,
    )
    now[0] = 1.0
    stats.append(SchedulerStats(num_waiting_reqs=1, step_id=9, prefix_cache_queries=100,
                                prefix_cache_hits=75, num_generation_tokens=50,
                                num_waiting_tokens=40))  # fmt: skip
    load = reporter.load()
    assert (load.gen_throughput, load.cache_hit_rate, load.num_waiting_uncached_tokens) == (
        50.0, 0.75, 10,
    )  # fmt: skip


def test_the_load_record_carries_the_lora_slots_in_use() -> None:
    """smg's EngineLoad.lora: the running adapters' slots of --max-loras (unset: LoRA off)."""
    stats = SchedulerStats(num_running_reqs=3, running_lora_adapters=["a", "b"])
    lora_info = dataclasses.replace(INFO, options=replace_options(INFO.options, max_loras=4))
    for info, expected in ((lora_info, (2, 4, 0.5)), (INFO, None)):
        load = LoadReporter(info, lambda: stats).load()
        record = engine_load_from(convert.scheduler_load_to_proto(load, 0), queued_token_work=True)
        convert.add_lora_load(load, record)
        lora = record.lora
        got = (lora.slots_used, lora.slots_total, lora.utilization)
        assert (got if record.HasField("lora") else None) == expected

"""Deterministically populated instances of every contract message, for contract tests."""

from __future__ import annotations

from types import ModuleType

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.core.v1 import core_service_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2
from splitserve_contracts.worker.v1 import worker_service_pb2

CONTRACT_MODULES: tuple[ModuleType, ...] = (
    types_pb2,
    core_service_pb2,
    worker_service_pb2,
    generation_service_pb2,
)
_FD = FieldDescriptor


def all_message_classes() -> list[type[Message]]:
    classes = []
    for module in CONTRACT_MODULES:
        for name in module.DESCRIPTOR.message_types_by_name:
            classes.append(getattr(module, name))
    return classes


def _scalar(field: FieldDescriptor, seed: int) -> object:
    if field.type == _FD.TYPE_STRING:
        return f"{field.name}-{seed}-\u00e9\u4e2d"
    if field.type == _FD.TYPE_BYTES:
        return bytes([seed % 256, 0, 255])
    if field.type == _FD.TYPE_BOOL:
        return True
    if field.type in (_FD.TYPE_FLOAT, _FD.TYPE_DOUBLE):
        return 0.5 + seed
    if field.type == _FD.TYPE_ENUM:
        values = field.enum_type.values
        if len(values) == 1:  # google.protobuf.NullValue
            return values[0].number
        return values[min(len(values) - 1, 1 + seed % (len(values) - 1))].number
    if field.type in (_FD.TYPE_INT32, _FD.TYPE_INT64, _FD.TYPE_SINT32, _FD.TYPE_SINT64):
        return -(seed + 3) if seed % 2 else seed + 3
    return seed + 300  # unsigned: past one varint byte


def fill(msg: Message, seed: int = 1, depth: int = 0) -> Message:
    """Set every field of `msg` (each oneof ends on its last member) to a non-default value."""
    descriptor: Descriptor = msg.DESCRIPTOR
    for field in descriptor.fields:
        value = getattr(msg, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key_field = field.message_type.fields_by_name["key"]
            val_field = field.message_type.fields_by_name["value"]
            for i in range(2):
                key = _scalar(key_field, seed + i)
                if val_field.message_type is not None:  # e.g. google.protobuf.Struct's fields
                    if depth < 3:
                        fill(value[key], seed + i, depth + 1).SetInParent()
                else:
                    value[key] = _scalar(val_field, seed + i)
        elif field.message_type is not None:
            if depth >= 3:
                continue
            targets = [value.add() for _ in range(2)] if field.is_repeated else [value]
            for i, target in enumerate(targets):
                fill(target, seed + i, depth + 1)
                if not field.is_repeated and not target.ListFields():
                    target.SetInParent()
        elif field.is_repeated:
            value.extend(_scalar(field, seed + i) for i in range(3))
        else:
            setattr(msg, field.name, _scalar(field, seed))
    return msg


def representative_messages() -> dict[str, Message]:
    """Messages whose exact wire bytes are pinned by golden files."""
    sp = types_pb2.SamplingParams(
        n=2,
        temperature=0.0,
        top_p=0.9,
        top_k=40,
        seed=7,
        stop=["\n\n"],
        stop_token_ids=[2],
        max_tokens=16,
        logprobs=0,
        skip_special_tokens=False,
        logit_bias={5: -1.5},
    )
    sampler = types_pb2.SamplerParams(
        temperature=0.0, top_p=0.9, top_k=40, seed=7, logprobs=0, logit_bias={5: -1.5}
    )
    core_req = core_service_pb2.EngineCoreRequest(
        request_id="req-1",
        request_handle=42,
        prompt_token_ids=[1, 300, 70000],
        eos_token_id=2,
        cache_salt="tenant-a",
        priority=-1,
        max_tokens=16,
        min_tokens=1,
        stop_token_ids=[3],
        sampler_params=sampler,
    )
    outputs = core_service_pb2.EngineCoreOutputs(
        request_handles=[42, 43],
        num_new_tokens=[1, 2],
        new_token_ids=[17, 18, 19],
        details=[
            core_service_pb2.EngineCoreOutput(
                request_handle=43,
                finish_reason=types_pb2.FINISH_REASON_STOP,
                stop_token_id=19,
                events=[
                    core_service_pb2.EngineCoreEvent(
                        type=core_service_pb2.ENGINE_CORE_EVENT_TYPE_SCHEDULED, timestamp=12.5
                    )
                ],
            )
        ],
        timestamp=13.25,
        step_id=9,
    )
    step = worker_service_pb2.SchedulerOutput(
        step_id=3,
        scheduled_new_reqs=[
            worker_service_pb2.NewRequestData(
                req_handle=1,
                request_id="r",
                prompt_token_ids=[5, 6, 7],
                sampler_params=sampler,
                block_ids=[1, 2],
                num_computed_tokens=0,
                stop_token_ids=[2, 3],
                min_tokens=1,
            )
        ],
        scheduled_cached_reqs=worker_service_pb2.CachedRequestData(
            req_handles=[2],
            num_computed_tokens=[33],
            num_new_block_ids=[1],
            new_block_ids=[9],
            num_new_token_ids=[1],
            new_token_ids=[77],
        ),
        num_scheduled_tokens=[3, 1],
        total_num_scheduled_tokens=4,
        finished_req_handles=[4],
    )
    runner = worker_service_pb2.ModelRunnerOutput(
        step_id=3,
        status=worker_service_pb2.STEP_STATUS_OK,
        req_handles=[1, 2],
        sampled_token_ids=[11, 12],
        timings=worker_service_pb2.StepTimings(total_seconds=0.25),
    )
    gen = generation_service_pb2.GenerateResponse(
        request_id="req-1",
        index=1,
        token_ids=[17],
        text="h\u00e9",
        finish_reason=types_pb2.FINISH_REASON_LENGTH,
        usage=generation_service_pb2.Usage(prompt_tokens=3, completion_tokens=16, cached_tokens=0),
    )
    return {
        "sampling_params": sp,
        "engine_core_request": core_req,
        "engine_core_outputs": outputs,
        "scheduler_output": step,
        "model_runner_output": runner,
        "generate_response": gen,
    }

"""Protobuf <-> worker types: defaults of unset fields, columnar diffs, outputs."""

from __future__ import annotations

import numpy as np
import pytest

from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.output_types import (
    LogprobsTable,
    ModelRunnerOutput,
    RequestLogprobs,
    StepStatus,
    StepTimings,
)
from splitserve_contracts.worker.v1 import worker_service_pb2 as pb
from tests.fixtures.load_requests import load_request
from worker_svc import convert


def test_new_requests_carry_the_sampler_params_and_stop_conditions() -> None:
    sampler = types_pb2.SamplerParams(temperature=0.0, top_k=-1, seed=0, logprobs=0)
    msg = pb.SchedulerOutput(
        step_id=1,
        scheduled_new_reqs=[
            pb.NewRequestData(
                req_handle=1, prompt_token_ids=[5], block_ids=[3], stop_token_ids=[1, 2],
                sampler_params=sampler, min_tokens=4,
            )
        ],
    )  # fmt: skip
    new = convert.scheduler_output_from_proto(msg).scheduled_new_reqs[0]
    assert (new.sampling.temperature, new.sampling.top_k, new.sampling.seed) == (0.0, -1, 0)
    assert new.sampling.logprobs == 0 and new.sampling.prompt_logprobs is None
    assert new.sampling.repetition_penalty == 1.0  # unset: the contract's default
    assert new.min_tokens == 4 and new.stop_token_ids.tolist() == [1, 2]


def test_scheduler_output_columns() -> None:
    msg = pb.SchedulerOutput(
        step_id=9,
        scheduled_new_reqs=[
            pb.NewRequestData(
                req_handle=1,
                prompt_token_ids=[5, 6],
                block_ids=[3],
                num_computed_tokens=0,
                stop_token_ids=[1],
            )
        ],
        scheduled_cached_reqs=pb.CachedRequestData(
            req_handles=[2, 3],
            num_computed_tokens=[7, 0],
            num_new_block_ids=[0, 2],
            new_block_ids=[8, 9],
            num_new_token_ids=[1, 0],
            new_token_ids=[44],
            resumed_req_handles=[3],
            num_resumed_token_ids=[3],
            resumed_all_token_ids=[1, 2, 3],
        ),
        num_scheduled_tokens=[2, 1, 3],
        total_num_scheduled_tokens=6,
        finished_req_handles=[4],
    )
    step = convert.scheduler_output_from_proto(msg)
    assert step.step_id == 9 and step.num_reqs == 3
    new = step.scheduled_new_reqs[0]
    assert new.prompt_token_ids.tolist() == [5, 6] and new.stop_token_ids.tolist() == [1]
    cached = step.scheduled_cached_reqs
    assert cached.new_block_ids.tolist() == [8, 9] and cached.resumed_req_handles.tolist() == [3]
    assert cached.resumed_all_token_ids.dtype == np.int64
    assert step.num_scheduled_tokens.tolist() == [2, 1, 3]
    assert step.finished_req_handles.tolist() == [4]


def test_output_to_proto_flattens_tables() -> None:
    table = LogprobsTable(1, [5, 5, 6, 2], [-0.1, -0.1, -2.0, -0.5], [1, 3])
    out = ModelRunnerOutput(
        step_id=3,
        status=StepStatus.OK,
        rank=1,
        req_handles=[10, 11],
        sampled_token_ids=[5, 6],
        logprobs=[RequestLogprobs(10, table)],
        prompt_logprobs=[RequestLogprobs(11, table)],
        timings=StepTimings(0.1, 0.2, 0.3, 0.7),
        num_used_kv_blocks=4,
    )
    msg = convert.model_runner_output_to_proto(out)
    assert msg.status == pb.STEP_STATUS_OK and (msg.step_id, msg.rank) == (3, 1)
    assert list(msg.req_handles) == [10, 11] and list(msg.sampled_token_ids) == [5, 6]
    assert list(msg.logprobs[0].table.token_ids) == [5, 5, 6, 2]
    assert list(msg.logprobs[0].table.ranks) == [1, 3]
    assert msg.prompt_logprobs[0].req_handle == 11
    assert msg.timings.total_seconds == pytest.approx(0.7) and msg.num_used_kv_blocks == 4


def test_load_model_request_validation() -> None:
    config = convert.load_model_config_from_proto(load_request("/m", block_size=8, rank=1))
    options = config.options
    assert (options.model.dtype, options.model.attention_backend) == ("auto", "auto")
    assert options.parallel.tensor_parallel_size == 1 and config.rank == 1
    assert options.cache.block_size == 8 and options.parallel.enable_expert_parallel is False
    expert_parallel = load_request("/m", enable_expert_parallel=True)
    config = convert.load_model_config_from_proto(expert_parallel)
    assert config.options.parallel.enable_expert_parallel is True
    with pytest.raises(ValueError, match="model.dtype is 'int8'"):
        convert.load_model_config_from_proto(load_request("/m", dtype="int8"))
    with pytest.raises(ValueError, match="model.attention_backend is 'sdpa'; choose one of auto"):
        convert.load_model_config_from_proto(load_request("/m", attention_backend="sdpa"))
    # Unset fields read as the contract's defaults (block_size 16).
    assert convert.load_model_config_from_proto(load_request("/m")).options.cache.block_size == 16
    # No model path: the worker serves the embedded default model (built on first use).
    assert convert.load_model_config_from_proto(load_request(block_size=8)).model_path == ""


def test_loaded_model_carries_the_kv_sliding_window() -> None:
    from worker_svc.model_loader.model_load import LoadedModel

    loaded = LoadedModel("MistralForCausalLM", 512, 64, "float32", 1, 0.1, "torch", 2, 2, 16, 6)
    msg = convert.loaded_model_to_proto(loaded)
    assert msg.sliding_window == 6 and msg.head_dim == 16

"""Helpers for end-to-end tests of engines with a KV connector (tests/e2e/test_pd_gateway.py,
test_kv_connector_seam.py): requests by token ids over the VllmEngine contract, counters that
grow, KV that is freed."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc

from benchmarks.dp_serve import engine_metric
from tests.e2e.stack import Stack

FLAGS = ["--max-model-len", "512", "--kv-cache-memory-bytes", str(8 << 20)]
PROMPT = list(range(40, 140))
"""100 tokens: 6 full blocks and a partial one (block size 16)."""
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"


def stub(stack: Stack) -> pb_grpc.VllmEngineStub:
    return pb_grpc.VllmEngineStub(grpc.insecure_channel(stack.frontend))


def tokenized(
    request_id: str, max_tokens: int, prompt: list[int] = PROMPT, **fields: Any
) -> pb.GenerateRequest:
    params = pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return pb.GenerateRequest(
        request_id=request_id,
        tokenized=pb.TokenizedInput(input_ids=prompt),
        sampling_params=params,
        stream=False,
        **fields,
    )


def complete(engine: Stack, request: pb.GenerateRequest) -> pb.GenerateComplete:
    (reply,) = stub(engine).Generate(request, timeout=60)
    return reply.complete


def metric_grows_by(http: str, name: str, before: float, amount: float) -> None:
    """The engine's counter reaches `before + amount` within 3 s (its stats arrive periodically)."""
    deadline = time.monotonic() + 3.0
    while (value := engine_metric(http[7:], name)) - before < amount:
        assert time.monotonic() < deadline, f"{name} grew by {value - before}, not {amount}"
        time.sleep(0.05)
    assert value - before == amount


def wait_kv_free(*stacks: Stack, within: float) -> float:
    """Seconds until no block is used (nor leased) on any of the stacks; fails after `within`."""
    started = time.monotonic()
    while True:
        stats = [s.scheduler_stats() for s in stacks]
        if all(s.num_used_blocks == 0 and s.num_sending_reqs == 0 for s in stats):
            return time.monotonic() - started
        assert time.monotonic() - started < within, [str(s) for s in stats]
        time.sleep(0.02)


def connector(role: str, engine_id: str) -> list[str]:
    """An engine core's flags for the GrpcConnector in `role` as `engine_id`."""
    config = {"kv_connector": "GrpcConnector", "kv_role": role, "engine_id": engine_id}
    return [*FLAGS, "--kv-transfer-config", json.dumps(config)]


@contextmanager
def running(*stacks: Stack) -> Iterator[tuple[Stack, ...]]:
    """Start `stacks` in order; every one that started is stopped when the block ends, or
    when a later one fails to start."""
    started: list[Stack] = []
    try:
        for stack in stacks:
            started.append(stack.start())
        yield tuple(started)
    finally:
        for stack in started:
            stack.stop()

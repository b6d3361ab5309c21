"""`--kv-cache-dtype fp8` served end to end: a TP=2 stack with an fp8 cache of a few blocks
(requests preempted and recomputed), speculative decoding, async scheduling and prefix caching
(the prompts share a prefix) reports twice a bf16 cache's blocks for its memory, answers with
the tokens the offline engine decodes over the same fp8 cache one plain step at a time, and
scores a text within fp8's precision of the model-dtype cache.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
from tests.e2e.client import generate
from tests.e2e.stack import Stack
from tests.e2e.test_openai_http import get, post

pytestmark = pytest.mark.slow

FP8_BLOCK_BYTES = 4 * 2 * 16 * 1 * 64
"""The tiny model at TP=2: 4 layers x (K, V) x 16 tokens x 1 KV head x 64 dims x 1 byte."""
NUM_BLOCKS = 16
"""8 blocks hold one max_model_len request; the 8 requests below need about 24 at once."""
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
PREFIX = list(range(100, 120))
PROMPTS = [[*PREFIX, 300 + 7 * i, 301 + 5 * i] for i in range(8)]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def fp8_stack(tiny_model_dir: Path) -> Iterator[Stack]:
    flags = [
        *("--kv-cache-dtype", "fp8", "--max-model-len", "128"),
        *("--kv-cache-memory-bytes", str(NUM_BLOCKS * FP8_BLOCK_BYTES)),
        *("--speculative-config", json.dumps(SPEC)),
    ]
    running = Stack(tiny_model_dir, tp=2, core_flags=flags).start()
    yield running
    running.stop()


def test_the_engine_reports_twice_the_blocks_of_bf16(fp8_stack: Stack) -> None:
    status, text = get(fp8_stack.http, "/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}
    info = families["vllm:cache_config_info"].samples[0].labels
    bf16_blocks = NUM_BLOCKS * FP8_BLOCK_BYTES // (2 * FP8_BLOCK_BYTES)
    assert info["cache_dtype"] == "fp8"
    assert int(info["num_gpu_blocks"]) == 2 * bf16_blocks == NUM_BLOCKS


def test_served_tokens_equal_plain_decoding_over_the_fp8_cache(
    fp8_stack: Stack, tiny_model_dir: Path
) -> None:
    """Every KV read agrees: drafts verified, preempted requests recomputed, prefixes reused
    from the cache, two TP ranks (each its own KV head) give what one rank decoding one token
    per step over a roomy fp8 cache gives."""
    from splitserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(tiny_model_dir), kv_cache_dtype="fp8", max_model_len=128) as llm:
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        expected = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]

    def served(prompt: list[int]) -> list[int]:
        sampling = types_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        request = gen_pb2.GenerateRequest(
            prompt_token_ids=gen_pb2.TokenIds(ids=prompt), sampling_params=sampling
        )
        return generate(fp8_stack.frontend, request)[0].token_ids

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        tokens = list(pool.map(served, PROMPTS))
    assert tokens == expected
    _, text = get(fp8_stack.http, "/metrics")
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert values["vllm:num_preemptions_total"] > 0, values
    assert values["vllm:spec_decode_num_accepted_tokens_total"] > 0
    assert values["vllm:prefix_cache_hits_total"] > 0


def test_prompt_logprobs_stay_within_fp8_precision(fp8_stack: Stack, stack: Stack) -> None:
    """Teacher-forced: each prompt token's logprob with the fp8 (e4m3) cache against the
    float32 cache's (float32 compute on both stacks). e4m3 rounds each key and value by up to
    2^-4 of itself; on this model that moves logprobs by 0.027 nats at most, 0.008 on average
    (measured in process), while its logprobs spread over ±0.3 nats, about what a misread
    cache would move them by."""
    prompt = [*PREFIX, *range(500, 560)]
    body = {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0.0}
    rows = {}
    for name, engine in (("fp8", fp8_stack), ("auto", stack)):
        status, reply = post(engine.http, "/v1/completions", body | {"model": "tiny-llama-v1"})
        assert status == 200, reply
        scored = reply["choices"][0]["prompt_logprobs"][1:]
        rows[name] = [row[str(token)] for row, token in zip(scored, prompt[1:], strict=True)]
    errors = [
        abs(a["logprob"] - b["logprob"]) for a, b in zip(rows["fp8"], rows["auto"], strict=True)
    ]
    assert 0 < max(errors) < 0.05 and sum(errors) / len(errors) < 0.02, errors

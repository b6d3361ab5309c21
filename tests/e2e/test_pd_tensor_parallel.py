"""P/D between two engines of two tensor-parallel ranks each: rank i of the decode engine pulls
its half of the prompt's KV (its KV heads) from rank i of the prefill engine, every rank reports
its part, and the load is done once both did: greedy tokens equal to the decode engine computing
the prompt itself, external hits = the prompt, KV freed on both engines."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from smg_grpc_proto.generated import common_pb2

from benchmarks.dp_serve import engine_metric
from tests.e2e.kv_engines import (
    EXTERNAL_HITS,
    PROMPT,
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


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> Iterator[tuple[Stack, Stack]]:
    prefill = Stack(tiny_model_dir, tp=2, core_flags=connector("kv_producer", "prefill-tp"))
    decode = Stack(tiny_model_dir, tp=2, core_flags=connector("kv_consumer", "decode-tp"))
    with running(prefill, decode):
        yield prefill, decode


@pytest.mark.extended  # make test's P/D tests (test_pd_gateway, test_pd_serve) run at TP=1
def test_each_rank_pulls_its_part_and_the_answer_is_the_same(
    engines: tuple[Stack, Stack],
) -> None:
    prefill, decode = engines
    expected = list(complete(decode, tokenized("alone", 10)).output_ids)
    flushed = stub(decode).FlushCache(common_pb2.FlushCacheRequest(timeout_s=10), timeout=30)
    assert flushed.success, flushed.message  # the prompt must come from the peer, not the cache
    handoff = json.loads(complete(prefill, tokenized("pd-tp", 1)).kv_transfer_params_json)
    assert handoff["tp_size"] == 2 and len(set(handoff["remote_addresses"])) == 2
    hits = engine_metric(decode.http[7:], EXTERNAL_HITS)
    got = complete(decode, tokenized("pd-tp", 10, kv_transfer_params_json=json.dumps(handoff)))
    assert list(got.output_ids) == expected
    metric_grows_by(decode.http, EXTERNAL_HITS, hits, len(PROMPT))
    wait_kv_free(prefill, decode, within=2.0)

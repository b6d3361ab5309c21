"""The KV-connector seam has a second implementation: the SharedStorageConnector
(tests/kv_connectors/shared_storage), loaded by `kv_connector_module_path` as a user's own
connector is, with no line of the GrpcConnector's. Two engines share one folder: the first
computes a prompt and saves its KV; the second, given the same prompt, loads it instead of
computing it (external hits = the prompt) and answers the same greedy tokens; a saved file that
does not fit is a failed load, computed instead, with the same answer. KV is freed on both."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.dp_serve import engine_metric
from tests.e2e.kv_engines import (
    EXTERNAL_HITS,
    PROMPT,
    complete,
    metric_grows_by,
    running,
    tokenized,
    wait_kv_free,
)
from tests.e2e.stack import Stack
from tests.kv_connectors.shared_storage.scheduler import done_marker, prompt_key

pytestmark = pytest.mark.slow
FAILED_LOADS = "splitserve:kv_transfer_failed_loads_total"
LOADS = "splitserve:kv_transfer_loads_total"
KV_BYTES = "splitserve:kv_transfer_received_bytes_total"


def shared_storage(folder: Path) -> list[str]:
    config = {
        "kv_connector": "SharedStorageConnector",
        "kv_connector_module_path": "tests.kv_connectors.shared_storage",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(folder)},
    }
    flags = ["--max-model-len", "512", "--kv-cache-memory-bytes", str(8 << 20)]
    return [*flags, "--kv-transfer-config", json.dumps(config)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv-store")


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path, folder: Path) -> Iterator[tuple[Stack, Stack]]:
    first = Stack(tiny_model_dir, core_flags=shared_storage(folder))
    second = Stack(tiny_model_dir, core_flags=shared_storage(folder))
    with running(first, second):
        yield first, second


def saved(folder: Path, prompt: list[int], within: float = 5.0) -> None:
    """The prompt's KV is in the folder within `within` seconds (saved after it finished)."""
    deadline = time.monotonic() + within
    while not done_marker(folder, prompt_key(prompt)).exists():
        assert time.monotonic() < deadline, "the producer saved no KV for the prompt"
        time.sleep(0.02)


def counters(engine: Stack) -> dict[str, float]:
    names = (EXTERNAL_HITS, LOADS, FAILED_LOADS, KV_BYTES)
    return {name: engine_metric(engine.http[7:], name) for name in names}


def test_a_second_engine_loads_the_saved_prompt_instead_of_computing_it(
    engines: tuple[Stack, Stack], folder: Path
) -> None:
    first, second = engines
    computed = complete(first, tokenized("store-1", 12))
    saved(folder, PROMPT)
    before = counters(second)
    loaded = complete(second, tokenized("store-2", 12))
    assert list(loaded.output_ids) == list(computed.output_ids)
    metric_grows_by(second.http, EXTERNAL_HITS, before[EXTERNAL_HITS], len(PROMPT))
    metric_grows_by(second.http, LOADS, before[LOADS], 1)
    assert engine_metric(second.http[7:], KV_BYTES) > before[KV_BYTES]
    wait_kv_free(first, second, within=1.0)


def test_a_file_that_does_not_fit_is_computed_instead(
    engines: tuple[Stack, Stack], folder: Path
) -> None:
    first, second = engines
    prompt = [p + 200 for p in PROMPT[:70]]
    computed = complete(first, tokenized("bad-1", 8, prompt))
    saved(folder, prompt)
    data = folder / f"{prompt_key(prompt)}.rank0.npy"
    data.write_bytes(data.read_bytes()[: len(data.read_bytes()) // 2])  # a torn file
    before = counters(second)
    answer = complete(second, tokenized("bad-2", 8, prompt))
    assert list(answer.output_ids) == list(computed.output_ids)
    metric_grows_by(second.http, FAILED_LOADS, before[FAILED_LOADS], 1)
    assert engine_metric(second.http[7:], EXTERNAL_HITS) == before[EXTERNAL_HITS]
    wait_kv_free(first, second, within=1.0)


def test_a_prompt_nobody_saved_is_computed(engines: tuple[Stack, Stack]) -> None:
    second = engines[1]
    before = counters(second)
    reply = complete(second, tokenized("new-1", 4, [p + 300 for p in PROMPT[:40]]))
    assert len(reply.output_ids) == 4
    after = counters(second)
    assert after[EXTERNAL_HITS] == before[EXTERNAL_HITS] and after[LOADS] == before[LOADS]

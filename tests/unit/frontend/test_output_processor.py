"""OutputProcessor: deltas, stop strings across tokens with hold-back, stop tokens, logprobs."""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from frontend_svc.engine.detokenizer import backend_decoder
from frontend_svc.engine.engine_types import CoreOutputDetail, CoreOutputs
from frontend_svc.engine.output_processor import OutputProcessor
from frontend_svc.errors import EngineUnavailable, Overloaded
from frontend_svc.metrics import FrontendMetrics
from frontend_svc.requests import CompletionDelta
from splitserve_contracts.output_types import FinishReason, LogprobsTable
from splitserve_contracts.sampling_types import SamplingParams

HANDLE = 7


def metrics() -> FrontendMetrics:
    return FrontendMetrics(CollectorRegistry(), "m", "0", 64)


def step(handle: int, ids: list[int], detail: CoreOutputDetail | None = None) -> CoreOutputs:
    return CoreOutputs([handle], [len(ids)], ids, {handle: detail} if detail else {}, 0.0, 1)


def run(
    tokenizer: Any, params: SamplingParams, ids: list[int], last: CoreOutputDetail | None = None
) -> tuple[list[CompletionDelta], list[int]]:
    proc = OutputProcessor(backend_decoder(tokenizer), metrics())
    queue: asyncio.Queue[Any] = asyncio.Queue()
    proc.add_request(HANDLE, 0, params, 3, queue)
    aborted: list[int] = []
    for i, token in enumerate(ids):
        detail = last if i == len(ids) - 1 else None
        aborted += proc.process_outputs(step(HANDLE, [token], detail))
        if HANDLE not in proc.states:
            break
    deltas = []
    while not queue.empty():
        deltas.append(queue.get_nowait())
    return deltas, aborted


def text_of(deltas: list[CompletionDelta]) -> str:
    return "".join(d.text for d in deltas)


def test_plain_stream_and_length_finish(tokenizer: Any) -> None:
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    deltas, aborted = run(tokenizer, SamplingParams(), ids, CoreOutputDetail(HANDLE, 2))
    assert text_of(deltas) == "one two three"
    assert deltas[-1].finish_reason == FinishReason.LENGTH
    assert deltas[-1].completion_tokens == len(ids)
    assert [t for d in deltas for t in d.token_ids] == ids
    assert aborted == []


def test_stop_string_across_tokens_is_cut_and_aborted(tokenizer: Any) -> None:
    ids = tokenizer.encode("alpha beta gamma delta", add_special_tokens=False)
    params = SamplingParams(stop=("ta gam",))
    deltas, aborted = run(tokenizer, params, ids)
    assert text_of(deltas) == "alpha be"
    assert deltas[-1].finish_reason == FinishReason.STOP and deltas[-1].stop_str == "ta gam"
    assert aborted == [HANDLE]
    assert all("ta" not in d.text or d is deltas[-1] for d in deltas)


def test_stop_string_included(tokenizer: Any) -> None:
    ids = tokenizer.encode("alpha beta gamma delta", add_special_tokens=False)
    deltas, _ = run(
        tokenizer, SamplingParams(stop=("gamma",), include_stop_str_in_output=True), ids
    )
    assert text_of(deltas) == "alpha beta gamma"


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    words=st.lists(
        st.sampled_from(["river", "stone", "night", "data", "ab", "ba"]), min_size=1, max_size=12
    ),
    stop=st.sampled_from(["ab", "er st", "night", "zz", "a d"]),
)
def test_hold_back_never_leaks_stop_text(tokenizer: Any, words: list[str], stop: str) -> None:
    text = " ".join(words)
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, _ = run(tokenizer, SamplingParams(stop=(stop,)), ids, CoreOutputDetail(HANDLE, 2))
    streamed = text_of(deltas)
    cut = text.find(stop)
    assert streamed == (text if cut == -1 else text[:cut])
    if cut != -1:
        assert deltas[-1].stop_str == stop


def test_stop_token_text_is_not_emitted(tokenizer: Any) -> None:
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("done", add_special_tokens=False) + [eos]
    params = SamplingParams(skip_special_tokens=False)
    deltas, aborted = run(tokenizer, params, ids, CoreOutputDetail(HANDLE, 1, stop_token_id=eos))
    assert text_of(deltas) == "done"
    assert deltas[-1].stop_token_id == eos and deltas[-1].token_ids == [eos]
    assert aborted == []


def test_min_tokens_defers_stop_strings(tokenizer: Any) -> None:
    ids = tokenizer.encode("ab ab ab", add_special_tokens=False)
    deltas, _ = run(
        tokenizer,
        SamplingParams(stop=("ab",), min_tokens=len(ids)),
        ids,
        CoreOutputDetail(HANDLE, 2),
    )
    assert text_of(deltas) == "ab ab ab"


def test_logprobs_rows(tokenizer: Any) -> None:
    table = LogprobsTable(2, [10, 10, 11, 12, 12, 13], [-0.5, -0.5, -1.0, -2.0, -0.1, -3.0], [1, 2])
    proc = OutputProcessor(backend_decoder(tokenizer), metrics())
    queue: asyncio.Queue[Any] = asyncio.Queue()
    proc.add_request(HANDLE, 0, SamplingParams(logprobs=2), 3, queue)
    proc.process_outputs(step(HANDLE, [10, 12], CoreOutputDetail(HANDLE, new_logprobs=table)))
    delta = queue.get_nowait()
    assert [row.chosen.token_id for row in delta.logprobs] == [10, 12]
    assert [row.chosen.rank for row in delta.logprobs] == [1, 2]
    assert [t.rank for t in delta.logprobs[1].top] == [1, 2]
    assert delta.logprobs[1].top[0].token_id == 12


def test_unknown_handles_are_ignored_and_fail_all(tokenizer: Any) -> None:
    proc = OutputProcessor(backend_decoder(tokenizer), metrics())
    queue: asyncio.Queue[Any] = asyncio.Queue()
    proc.add_request(HANDLE, 0, SamplingParams(), 3, queue)
    assert proc.process_outputs(step(999, [5])) == []
    proc.fail_all("core went away")
    assert isinstance(queue.get_nowait(), EngineUnavailable)
    assert proc.states == {}


def test_a_client_that_never_reads_is_stopped_and_aborted(tokenizer: Any) -> None:
    from frontend_svc.engine.output_processor import MAX_UNREAD_DELTAS

    proc = OutputProcessor(backend_decoder(tokenizer), metrics())
    queue: asyncio.Queue[Any] = asyncio.Queue()
    proc.add_request(HANDLE, 0, SamplingParams(), 3, queue)
    aborted: list[int] = []
    for _ in range(MAX_UNREAD_DELTAS + 5):
        aborted += proc.process_outputs(step(HANDLE, [5]))
    assert aborted == [HANDLE] and HANDLE not in proc.states
    items = [queue.get_nowait() for _ in range(queue.qsize())]
    assert isinstance(items[-1], Overloaded) and "read none of its last" in str(items[-1])

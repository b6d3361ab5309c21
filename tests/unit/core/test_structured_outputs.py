"""The engine core's structured outputs with a scripted rank that samples only what the step's
grammar bitmask allows: outputs follow the grammar in lockstep and under async scheduling
(where masks wait for the previous step's token and travel on their own), the grammar's end
finishes the request, and bad grammars, a missing tokenizer and a compile past its time limit
fail only their own request."""

from __future__ import annotations

import os
import re
import time

import numpy as np
import pytest

from core_svc.engine.engine_core import EngineCore
from core_svc.request import Request
from core_svc.sched.scheduler_output import SchedulerOutput
from core_svc.structured_output.grammar_state import StructuredOutputRequest
from core_svc.structured_output.manager import StructuredOutputsConfig
from splitserve_contracts.output_types import ErrorKind, FinishReason
from splitserve_contracts.structured_outputs import StructuredOutputsParams
from splitserve_runtime.tiny_model import ensure_tiny_model
from tests.unit.core.fake_executor import ClientView, make_request
from tests.unit.core.masked_executor import (
    MaskedExecutor,
    compiled_states,
    masked_engine,
    run_engine,
)

VOCAB = 2048


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> str:
    cache = tmp_path_factory.mktemp("so-cache")
    folder = ensure_tiny_model({**os.environ, "SPLITSERVE_CACHE_DIR": str(cache)})
    return (folder / "tokenizer.json").read_text()


def _engine(
    tokenizer_json: str, async_scheduling: bool, timeout: float = 10.0
) -> tuple[EngineCore, MaskedExecutor]:
    return masked_engine(tokenizer_json, VOCAB, [1], async_scheduling, timeout)


def _constrained(handle: int, params: StructuredOutputsParams, max_tokens: int = 64) -> Request:
    request = make_request(handle, [5, 6, 7, 8, 9], max_tokens=max_tokens, eos_token_id=1)
    request.structured_output = StructuredOutputRequest(params)
    return request


_run = run_engine


def _error(view: ClientView, handle: int, client_id: int = 1) -> tuple[str, ErrorKind]:
    detail = view.details[(client_id, handle)][-1]
    return detail.error_message, detail.error_kind


def _decode(tokenizer_json: str, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json).decode(ids)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_outputs_follow_their_grammar_and_end_with_it(
    tokenizer_json: str, async_scheduling: bool
) -> None:
    engine, executor = _engine(tokenizer_json, async_scheduling)
    regexes = [r"[a-z]{2,5}-[0-9]{3}", r"(red|green|blue) [0-9]{1,2}", r"x{3}y?"]
    for handle, regex in enumerate(regexes, start=1):
        engine.add_request(_constrained(handle, StructuredOutputsParams(regex=regex)))
    engine.add_request(make_request(9, [3, 4, 5], max_tokens=12))  # unconstrained, alongside
    view = _run(engine, ClientView())
    for handle, regex in enumerate(regexes, start=1):
        assert view.finished[(1, handle)] == FinishReason.STOP, view.details
        assert re.fullmatch(regex, _decode(tokenizer_json, view.tokens[(1, handle)]))
    assert view.finished[(1, 9)] == FinishReason.LENGTH
    assert executor.num_masked_steps > 0
    assert not engine.structured.compiling and engine.scheduler.num_structured == 0


def test_async_steps_defer_their_masks(tokenizer_json: str) -> None:
    engine, _ = _engine(tokenizer_json, async_scheduling=True)
    engine.add_request(_constrained(1, StructuredOutputsParams(regex=r"[0-9]{20}")))
    deferred = []
    original = engine.structured.fill

    def watch(step: SchedulerOutput, rows: list[tuple[Request, int]]) -> bool:
        filled = original(step, rows)
        deferred.append(not filled)
        return filled

    engine.structured.fill = watch  # type: ignore[method-assign]
    view = _run(engine, ClientView())
    assert re.fullmatch(r"[0-9]{20}", _decode(tokenizer_json, view.tokens[(1, 1)]))
    assert any(deferred), "no decode waited for the previous step's token"


def test_bad_grammar_missing_tokenizer_and_timeout_fail_only_their_request(
    tokenizer_json: str,
) -> None:
    engine, _ = _engine(tokenizer_json, async_scheduling=False)
    engine.add_request(_constrained(1, StructuredOutputsParams(json='{"type": "nope"}')))
    engine.add_request(_constrained(2, StructuredOutputsParams(regex="[ab]{4}")))
    other = _constrained(3, StructuredOutputsParams(regex="a"))
    other.client_id = 2  # a stream that sent no tokenizer
    engine.add_request(other)
    view = _run(engine, ClientView())
    assert view.finished[(1, 1)] == FinishReason.ERROR
    assert "structured_outputs.json" in _error(view, 1)[0]
    assert "TokenizerInfo" in _error(view, 3, client_id=2)[0]
    assert view.finished[(1, 2)] == FinishReason.STOP
    slow, _ = _engine(tokenizer_json, async_scheduling=False, timeout=0.05)
    slow.structured.manager._compile_pool().submit(time.sleep, 0.5)  # a costly grammar ahead
    slow.add_request(_constrained(1, StructuredOutputsParams(json='{"type": "object"}')))
    timed_out = _run(slow, ClientView())
    assert timed_out.finished[(1, 1)] == FinishReason.ERROR
    assert "longer than" in _error(timed_out, 1)[0]


def test_resubmitted_outputs_rebuild_the_matcher(tokenizer_json: str) -> None:
    engine, _ = _engine(tokenizer_json, async_scheduling=False)
    from tokenizers import Tokenizer

    ids = Tokenizer.from_str(tokenizer_json).encode("12", add_special_tokens=False).ids
    request = make_request(1, [5, 6, 7], max_tokens=16, eos_token_id=1, output_token_ids=ids)
    request.structured_output = StructuredOutputRequest(StructuredOutputsParams(regex="[0-9]{6}"))
    engine.add_request(request)
    bad = make_request(2, [5, 6, 7], max_tokens=16, output_token_ids=[ids[0], 200])
    bad.structured_output = StructuredOutputRequest(StructuredOutputsParams(regex="[0-9]{6}"))
    engine.add_request(bad)
    view = _run(engine, ClientView())
    assert re.fullmatch(r"[0-9]{4}", _decode(tokenizer_json, view.tokens[(1, 1)]))
    if _decode(tokenizer_json, [200]).isdigit():
        return
    assert view.finished[(1, 2)] == FinishReason.ERROR
    assert _error(view, 2)[1] == ErrorKind.INVALID_REQUEST


THINK_END = 700
"""A token standing for `</think>` (any id: the core only compares ids)."""


def test_grammar_starts_after_the_reasoning_end_token(tokenizer_json: str) -> None:
    """vLLM's reasoning_ended: unconstrained tokens until the reasoning end token, then the
    grammar; a resubmitted request whose outputs hold the end token rebuilds its matcher from
    the tokens after it, and one whose outputs do not is still reasoning."""
    engine, executor = _engine(tokenizer_json, async_scheduling=True)
    thinking = [300, 301, 302]  # not digits: the grammar would refuse them
    live = make_request(1, [5, 6, 7], max_tokens=32, eos_token_id=1, request_id="live")
    live.structured_output = StructuredOutputRequest(
        StructuredOutputsParams(regex="[0-9]{6}"), THINK_END
    )
    executor.scripts["live"] = [*thinking, THINK_END]
    engine.add_request(live)
    from tokenizers import Tokenizer

    digits = Tokenizer.from_str(tokenizer_json).encode("12", add_special_tokens=False).ids
    resumed = make_request(
        2, [5, 6, 7], max_tokens=32, eos_token_id=1, output_token_ids=[300, THINK_END, *digits]
    )
    resumed.structured_output = StructuredOutputRequest(
        StructuredOutputsParams(regex="[0-9]{6}"), THINK_END
    )
    engine.add_request(resumed)
    still = make_request(3, [5, 6, 7], max_tokens=32, eos_token_id=1, output_token_ids=[300, 301])
    still.structured_output = StructuredOutputRequest(StructuredOutputsParams(regex="x"), THINK_END)
    executor.scripts[still.request_id] = [300, 301, 303, THINK_END]
    engine.add_request(still)
    view = _run(engine, ClientView())
    tokens = view.tokens[(1, 1)]
    assert tokens[:4] == [*thinking, THINK_END]
    assert re.fullmatch(r"[0-9]{6}", _decode(tokenizer_json, tokens[4:]))
    assert view.finished[(1, 1)] == FinishReason.STOP
    assert re.fullmatch(r"[0-9]{4}", _decode(tokenizer_json, view.tokens[(1, 2)]))
    assert view.tokens[(1, 3)][:2] == [303, THINK_END]
    assert _decode(tokenizer_json, view.tokens[(1, 3)][2:]) == "x"


def test_the_engine_keeps_stepping_while_a_grammar_compiles(tokenizer_json: str) -> None:
    """A compile held on a gate (a schema as slow as you like): the unconstrained request
    decodes to its end meanwhile; once the gate opens the constrained one runs under its
    grammar. Compiling on the step loop would hold the other request (here: hang, then fail)."""
    import threading

    engine, _ = _engine(tokenizer_json, async_scheduling=False)
    gate, compiling = threading.Event(), threading.Event()
    manager = engine.structured.manager
    compile_grammar = manager._compile_grammar

    def held(*args: object) -> object:
        compiling.set()
        assert gate.wait(30), "the gate never opened"
        return compile_grammar(*args)  # type: ignore[arg-type]

    manager._compile_grammar = held  # type: ignore[method-assign]
    engine.add_request(_constrained(1, StructuredOutputsParams(regex=r"[0-9]{3}")))
    engine.add_request(make_request(2, [3, 4, 5], max_tokens=12))
    assert compiling.wait(30)
    view = ClientView()
    while engine.has_work():
        view.absorb(engine.step())
    assert view.finished[(1, 2)] == FinishReason.LENGTH and len(view.tokens[(1, 2)]) == 12
    assert (1, 1) not in view.tokens and engine.structured.compiling
    gate.set()
    view = _run(engine, view)
    assert re.fullmatch(r"[0-9]{3}", _decode(tokenizer_json, view.tokens[(1, 1)]))


def test_grammar_cache_counters_reach_vllms_metric_names(tokenizer_json: str) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from core_svc.metrics import CoreMetrics

    engine, _ = _engine(tokenizer_json, async_scheduling=False)
    for handle in (1, 2):  # one compile thread: the second finds the first's grammar
        engine.add_request(_constrained(handle, StructuredOutputsParams(regex="[ab]{3}")))
    _run(engine, ClientView())
    registry = CollectorRegistry()
    metrics = CoreMetrics(registry, "m", "0", {"block_size": "4"})
    manager = engine.structured.manager
    metrics.watch_structured_outputs(lambda: (manager.num_cache_queries, manager.num_cache_hits))
    text = generate_latest(registry).decode()
    labels = '{engine="0",model_name="m"}'
    assert f"vllm:structured_output_cache_queries_total{labels} 2.0" in text
    assert f"vllm:structured_output_cache_hits_total{labels} 1.0" in text


def test_filled_rows_are_llguidances_with_the_padding_bits_set(tokenizer_json: str) -> None:
    """The fill writes each matcher's row in place (llguidance's fill_next_token_bitmask,
    without its per-row checks), and sets the last word's bits past the vocabulary, so a row
    that allows every token is all -1 words (sent as nothing on the sparse wire form)."""
    from llguidance.numpy import fill_next_token_bitmask

    from core_svc.structured_output.manager import StructuredOutputManager

    vocab_size = VOCAB + 5  # the last word holds 5 tokens and 27 padding bits
    manager = StructuredOutputManager(vocab_size, StructuredOutputsConfig())
    manager.set_tokenizer(1, tokenizer_json, [1])
    regexes = (r"[0-9]{3}", r"(?s:.*)", r"yes|no")
    states = compiled_states(manager, [StructuredOutputsParams(regex=r) for r in regexes])
    words = np.frombuffer(manager.fill_bitmask(states), "<i4").reshape(len(states), -1)
    expected = np.zeros_like(words)
    for row, state in enumerate(states):
        fill_next_token_bitmask(state.matcher, expected, row)  # type: ignore[arg-type]
    padding = np.int32(-(1 << 5))
    assert np.array_equal(words[:, :-1], expected[:, :-1])
    assert np.array_equal(words[:, -1], expected[:, -1] | padding)
    assert (expected[:, -1] & padding == 0).all()  # llguidance leaves the padding bits clear
    manager.shutdown()


HUGE_REGEX = "((a|aa){50}){50}"
"""Legal (at least 2,500 characters), but its lexer outgrows one of llguidance's limits on its
first `a` (issue 37 item 6)."""
LEXER_LIMIT = (
    "structured_outputs.regex: the grammar could not be followed: lexer error: too many "
    "expressions constructed"
)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_grammar_past_the_matchers_limits_fails_by_name_request_after_request(
    tokenizer_json: str, async_scheduling: bool
) -> None:
    """Three requests in turn, each with a request beside it: each fails with INVALID_REQUEST
    naming llguidance's limit, never ENGINE_FAILURE blaming the rank (a 503 "retry it") nor STOP
    with an empty output (a copy of the cached grammar, whose lexer the first had exhausted,
    allowed EOS only and took it for the grammar's end); each compiles its grammar anew, and
    the requests beside them are served."""
    engine, _ = _engine(tokenizer_json, async_scheduling)
    for handle in (1, 2, 3):
        engine.add_request(_constrained(handle, StructuredOutputsParams(regex=HUGE_REGEX)))
        engine.add_request(_constrained(10 + handle, StructuredOutputsParams(regex="[0-9]{4}")))
        view = _run(engine, ClientView())
        assert view.finished[(1, handle)] == FinishReason.ERROR, view.details[(1, handle)]
        assert _error(view, handle) == (LEXER_LIMIT, ErrorKind.INVALID_REQUEST)
        assert view.finished[(1, 10 + handle)] == FinishReason.STOP
    assert engine.structured.manager.num_compiled == 4  # the regex thrice, the digits once


def test_a_failed_matcher_is_not_a_complete_grammar(tokenizer_json: str) -> None:
    """llguidance stops a matcher that failed, as it stops a complete one, masks EOS only for
    it and lets it "consume" EOS: accept refuses that EOS, and the refusal names the failure
    (INVALID_REQUEST, the cached grammar spent), as for the token that failed it."""
    from core_svc.structured_output.manager import StructuredOutputManager

    manager = StructuredOutputManager(VOCAB, StructuredOutputsConfig(num_compile_threads=1))
    manager.set_tokenizer(1, tokenizer_json, [1])
    params = [StructuredOutputsParams(regex=HUGE_REGEX)] * 2
    first, second = compiled_states(manager, params)  # second: a copy of the cached first
    assert second.template is first.template and manager.num_cache_hits == 1
    allowed = np.flatnonzero(_unpacked(manager.fill_bitmask([first])))
    assert not first.accept(int(allowed[0]))
    assert first.refusal(int(allowed[0]), True) == (ErrorKind.INVALID_REQUEST, LEXER_LIMIT)
    assert first.template is not None and first.template.is_spent
    assert np.flatnonzero(_unpacked(manager.fill_bitmask([second]))).tolist() == [1]  # EOS
    assert second.matcher is not None and second.matcher.is_stopped()
    assert not second.accept(1)
    assert second.refusal(1, True) == (ErrorKind.INVALID_REQUEST, LEXER_LIMIT)


def test_a_token_the_mask_refused_is_the_ranks_fault(tokenizer_json: str) -> None:
    """A rank that samples past its mask (here: ignores it) fails the request with
    ENGINE_FAILURE, as before; only a token the mask allowed is blamed on the grammar."""
    engine, executor = _engine(tokenizer_json, async_scheduling=False)
    letter = _encode(tokenizer_json, "x")
    request = _constrained(1, StructuredOutputsParams(regex="[0-9]{4}"))
    executor.ignores_mask.add(request.request_id)
    executor.scripts[request.request_id] = [letter]
    engine.add_request(request)
    view = _run(engine, ClientView())
    expected = f"the output rank sampled token {letter}, which the request's grammar does not allow"
    assert _error(view, 1) == (expected, ErrorKind.ENGINE_FAILURE)


def test_max_tokens_reached_mid_grammar_ends_with_length(tokenizer_json: str) -> None:
    engine, _ = _engine(tokenizer_json, async_scheduling=True)
    engine.add_request(_constrained(1, StructuredOutputsParams(regex="[0-9]{60}"), max_tokens=6))
    view = _run(engine, ClientView())
    assert view.finished[(1, 1)] == FinishReason.LENGTH and len(view.tokens[(1, 1)]) == 6
    assert re.fullmatch("[0-9]+", _decode(tokenizer_json, view.tokens[(1, 1)]))


def _unpacked(data: bytes) -> np.ndarray:
    return np.unpackbits(np.frombuffer(data, np.uint8), bitorder="little")[:VOCAB]


def _encode(tokenizer_json: str, text: str) -> int:
    from tokenizers import Tokenizer

    (token,) = Tokenizer.from_str(tokenizer_json).encode(text, add_special_tokens=False).ids
    return token

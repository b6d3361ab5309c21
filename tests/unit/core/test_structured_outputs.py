"""The engine core's structured outputs with a scripted rank that samples only what the step's
grammar bitmask allows: outputs follow the grammar in lockstep and under async scheduling
(where masks wait for the previous step's token and travel on their own), the grammar's end
finishes the request, and bad grammars, a missing tokenizer and a compile past its time limit
fail only their own request."""

from __future__ import annotations

import hashlib
import os
import re
import time

import numpy as np
import pytest

from core_svc.engine_core import EngineCore
from core_svc.request import Request
from core_svc.scheduler_config import CacheConfig, SchedulerConfig
from core_svc.scheduler_output import SchedulerOutput
from core_svc.structured_output import StructuredOutputRequest, StructuredOutputsConfig
from splitserve_contracts.output_types import ErrorKind, FinishReason, ModelRunnerOutput
from splitserve_contracts.structured_outputs import StructuredOutputsParams
from splitserve_runtime.tiny_model import ensure_tiny_model
from tests.unit.core.fake_executor import ClientView, FakeExecutor, ShadowRequest, make_request

VOCAB = 2048


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> str:
    cache = tmp_path_factory.mktemp("so-cache")
    folder = ensure_tiny_model({**os.environ, "SPLITSERVE_CACHE_DIR": str(cache)})
    return (folder / "tokenizer.json").read_text()


class MaskedExecutor(FakeExecutor):
    """A rank that samples, for a constrained request, a pseudo-random token its mask allows."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, verify_context=False, **kwargs)  # type: ignore[arg-type]
        self._masks: dict[int, np.ndarray] = {}
        self.num_masked_steps = 0
        self.num_deferred_steps = 0

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert not scheduler_output.has_pending_grammar, "ran before its masks came"
        grammar = scheduler_output.grammar_bitmask
        self._masks = {}
        if grammar is not None:
            self.num_masked_steps += 1
            words = np.frombuffer(grammar.bitmask, "<i4").reshape(len(grammar.req_handles), -1)
            for handle, row in zip(grammar.req_handles, words, strict=True):
                bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:VOCAB]
                self._masks[handle] = np.flatnonzero(bits)
        return super().execute_model(scheduler_output)

    def sample(self, shadow: ShadowRequest) -> int:
        handle = next(h for h, s in self.reqs.items() if s is shadow)
        allowed = self._masks.get(handle)
        if allowed is None:
            return super().sample(shadow)
        index = len(shadow.token_ids)
        digest = hashlib.sha256(f"{shadow.request_id}:{index}".encode()).digest()
        return int(allowed[int.from_bytes(digest[:4], "little") % len(allowed)])


def _engine(
    tokenizer_json: str, async_scheduling: bool, timeout: float = 10.0
) -> tuple[EngineCore, MaskedExecutor]:
    scheduler_config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=256,
        vocab_size=VOCAB,
        async_scheduling=async_scheduling,
    )
    executor = MaskedExecutor(4, 128, feeds_sampled=async_scheduling)
    engine = EngineCore(
        scheduler_config,
        CacheConfig(num_blocks=128, block_size=4),
        executor,
        structured_outputs_config=StructuredOutputsConfig(
            compile_timeout_s=timeout, num_compile_threads=1
        ),
    )
    engine.set_tokenizer(1, tokenizer_json, [1])
    return engine, executor


def _constrained(handle: int, params: StructuredOutputsParams, max_tokens: int = 64) -> Request:
    request = make_request(handle, [5, 6, 7, 8, 9], max_tokens=max_tokens, eos_token_id=1)
    request.structured_output = StructuredOutputRequest(params)
    return request


def _run(engine: EngineCore, view: ClientView, seconds: float = 20.0) -> ClientView:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if engine.has_work():
            view.absorb(engine.step())
        elif engine.structured.compiling:
            time.sleep(0.001)
        else:
            return view
    raise AssertionError("the engine is still busy")


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

    from core_svc.structured_output import StructuredOutputManager

    vocab_size = VOCAB + 5  # the last word holds 5 tokens and 27 padding bits
    manager = StructuredOutputManager(vocab_size, StructuredOutputsConfig())
    manager.set_tokenizer(1, tokenizer_json, [1])
    states = [
        StructuredOutputRequest(StructuredOutputsParams(regex=regex))
        for regex in (r"[0-9]{3}", r"(?s:.*)", r"yes|no")
    ]
    for handle, state in enumerate(states):
        assert manager.submit(handle, 1, state, []) is None
    deadline = time.monotonic() + 20
    while manager.num_compiling and time.monotonic() < deadline:
        assert not manager.take_compiled(time.monotonic())[1]
        time.sleep(0.01)
    words = np.frombuffer(manager.fill_bitmask(states), "<i4").reshape(len(states), -1)
    expected = np.zeros_like(words)
    for row, state in enumerate(states):
        fill_next_token_bitmask(state.matcher, expected, row)  # type: ignore[arg-type]
    padding = np.int32(-(1 << 5))
    assert np.array_equal(words[:, :-1], expected[:, :-1])
    assert np.array_equal(words[:, -1], expected[:, -1] | padding)
    assert (expected[:, -1] & padding == 0).all()  # llguidance leaves the padding bits clear
    manager.shutdown()

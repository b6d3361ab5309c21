"""Structured outputs when the tokenizer and the model's vocabulary differ in size (issue 37 item 1),
on transformers' Qwen2Tokenizer of 3,001 ids (tests/fixtures/qwen2_vocab.py) under a model of
3,000 ids (the tokenizer is wider) and of 3,072 (padded past the tokenizer, as Qwen2.5's): the
tokenizer is accepted, masks are the model's width, an id the model cannot emit is never
allowed and one the tokenizer lacks is masked; a grammar that can go on only through ids past
the model fails its request by name, and a draft that leads there is refused by the row before
it, while one that completes the grammar is not."""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest

from core_svc.structured_output.grammar_state import StructuredOutputRequest
from core_svc.structured_output.manager import StructuredOutputManager, StructuredOutputsConfig
from splitserve_contracts.output_types import ErrorKind, FinishReason
from splitserve_contracts.structured_outputs import StructuredOutputsParams
from tests.fixtures.qwen2_vocab import (
    ENDOFTEXT_ID,
    IM_END_ID,
    NUM_BPE_TOKENS,
    qwen2_tokenizer,
    qwen2_tokenizer_json,
)
from tests.unit.core.fake_executor import ClientView, make_request
from tests.unit.core.masked_executor import compiled_states, masked_engine, run_engine

NUM_TOKENIZER_IDS = NUM_BPE_TOKENS + 1
NARROW, PADDED = NUM_BPE_TOKENS, 3072
"""config.vocab_size below the tokenizer's ids (Qwen2Tokenizer's `<|endoftext|>` past it) and
padded past them."""
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
ONLY_PAST_THE_MODEL = 'start: "ab" <|endoftext|> "c"'
"""After `ab` the grammar goes on only through `<|endoftext|>`, id 3000."""


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    return qwen2_tokenizer_json()


def _manager(tokenizer_json: str, vocab_size: int, eos: list[int]) -> StructuredOutputManager:
    manager = StructuredOutputManager(vocab_size, StructuredOutputsConfig(num_compile_threads=1))
    manager.set_tokenizer(1, tokenizer_json, eos)
    return manager


def _rows(manager: StructuredOutputManager, data: bytes) -> np.ndarray:
    """The mask rows as booleans over the model's ids."""
    words = np.frombuffer(data, "<i4").reshape(-1, manager.masks.num_words)
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
    return bits[:, : manager.vocab_size].astype(bool)


def _ids(text: str) -> list[int]:
    return qwen2_tokenizer().encode(text)


@pytest.mark.parametrize("vocab_size", [NARROW, PADDED])
def test_masks_are_the_models_width_and_allow_only_ids_both_have(
    tokenizer_json: str, vocab_size: int
) -> None:
    """Each row is llguidance's own mask over the tokenizer (ids 0..3000), cut or padded to
    the model's width: no id past the tokenizer is allowed (3001..3071 of the padded model),
    and `<|endoftext|>` (3000) only where the model has it."""
    manager = _manager(tokenizer_json, vocab_size, [IM_END_ID])
    params = [
        StructuredOutputsParams(regex=r"(?s:.*)"),  # anything: every ordinary token
        StructuredOutputsParams(json=json.dumps(SCHEMA)),
        StructuredOutputsParams(grammar='start: "ab" (<|endoftext|> | "c")'),
    ]
    states = compiled_states(manager, params)
    assert states[2].matcher is not None and states[2].matcher.consume_tokens(_ids("ab"))
    rows = _rows(manager, manager.fill_bitmask(states))
    assert rows.shape == (3, vocab_size)
    for row, state in zip(rows, states, strict=True):
        assert state.matcher is not None and state.failure is None
        full = np.frombuffer(state.matcher.compute_bitmask(), np.uint8)
        own = np.unpackbits(full, bitorder="little")[: max(vocab_size, NUM_TOKENIZER_IDS)]
        assert np.array_equal(row, own[:vocab_size].astype(bool))
    assert not rows[:, NUM_TOKENIZER_IDS:].any()
    assert rows[0, :NUM_BPE_TOKENS].sum() > 0.9 * NUM_BPE_TOKENS and rows[0, IM_END_ID]
    assert rows[2, _ids("c")[0]]
    assert rows[2, ENDOFTEXT_ID:].any() == (vocab_size > ENDOFTEXT_ID)


@pytest.mark.parametrize("vocab_size", [NARROW, PADDED])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_constrained_requests_are_served_on_both_shapes(
    tokenizer_json: str, vocab_size: int, async_scheduling: bool
) -> None:
    """The issue's refusal ("vocab size too small; 3000 vs 3001") is gone: regex, JSON and Lark
    outputs follow their grammar and end with it; one whose only way on past `ab` is
    `<|endoftext|>` is served on the padded model (the MaskedExecutor samples only allowed ids,
    and fails the test on an empty mask) and fails by name on the narrow one."""
    engine, _ = masked_engine(tokenizer_json, vocab_size, [IM_END_ID], async_scheduling)
    cases = {
        1: StructuredOutputsParams(regex=r"[a-z]{2,5}-[0-9]{3}"),
        2: StructuredOutputsParams(json=json.dumps(SCHEMA)),
        3: StructuredOutputsParams(choice=("red city", "blue river")),
        4: StructuredOutputsParams(grammar=ONLY_PAST_THE_MODEL),
    }
    for handle, params in cases.items():
        request = make_request(handle, [5, 6, 7], max_tokens=64, eos_token_id=IM_END_ID)
        request.structured_output = StructuredOutputRequest(params)
        engine.add_request(request)
    view = run_engine(engine, ClientView())
    text = {h: qwen2_tokenizer().decode(view.tokens[(1, h)]) for h in cases}
    for handle in (1, 2, 3):
        assert view.finished[(1, handle)] == FinishReason.STOP, view.details[(1, handle)]
    assert re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", text[1])
    record = json.loads(text[2])
    assert set(record) == {"name", "age"} and isinstance(record["age"], int)
    assert text[3] in ("red city", "blue river")
    detail = view.details[(1, 4)][-1]
    if vocab_size > ENDOFTEXT_ID:
        assert view.finished[(1, 4)] == FinishReason.STOP and text[4] == "ab<|endoftext|>c"
    else:
        assert view.finished[(1, 4)] == FinishReason.ERROR and text[4] == "ab"
        assert detail.error_kind == ErrorKind.INVALID_REQUEST
        assert detail.error_message.startswith("structured_outputs.grammar: the grammar cannot")
        assert f"its {NARROW} ids" in detail.error_message


def test_a_grammar_complete_when_only_an_eos_past_the_model_follows_ends_with_it(
    tokenizer_json: str,
) -> None:
    """An end-of-sequence id the model cannot emit (`<|endoftext|>` as the only EOS on the
    narrow model): a grammar that completes stops there (STOP), one that may go on runs to
    max_tokens (LENGTH) with output that matches it, and one satisfied with nothing the model
    can emit next fails naming that."""
    engine, _ = masked_engine(tokenizer_json, NARROW, [ENDOFTEXT_ID])
    cases = {
        1: (StructuredOutputsParams(regex=r"ab(c|d)"), 16),
        2: (StructuredOutputsParams(regex=r"(red|blue) [0-9]+"), 12),
        3: (StructuredOutputsParams(grammar='start: "ab" (<|endoftext|> "x")?'), 16),
    }
    for handle, (params, max_tokens) in cases.items():
        request = make_request(handle, [5, 6, 7], max_tokens=max_tokens)
        request.structured_output = StructuredOutputRequest(params)
        engine.add_request(request)
    view = run_engine(engine, ClientView())
    text = {h: qwen2_tokenizer().decode(view.tokens[(1, h)]) for h in cases}
    assert view.finished[(1, 1)] == FinishReason.STOP and re.fullmatch("ab(c|d)", text[1])
    assert view.finished[(1, 2)] == FinishReason.LENGTH and len(view.tokens[(1, 2)]) == 12
    assert re.fullmatch(r"(red|blue) [0-9]+", text[2])
    detail = view.details[(1, 3)][-1]
    assert view.finished[(1, 3)] == FinishReason.ERROR, text[3]
    assert "the output satisfies it, but its end-of-sequence id is past" in detail.error_message


def test_a_draft_leading_past_the_model_is_refused_by_the_row_before_it(
    tokenizer_json: str,
) -> None:
    """Per-draft rows on the narrow model (speculative decoding): drafts `a`, `b` into
    ONLY_PAST_THE_MODEL lead where the model cannot go, so the row before each refuses it and
    the request fails (every row then allows everything: the rank never samples all -inf);
    into `ab(c|d)` they are kept; into `ab` (complete after them, its EOS past the model) they
    are kept and the row after them allows everything (the run ends at `b`)."""
    manager = _manager(tokenizer_json, NARROW, [ENDOFTEXT_ID])
    params = [
        StructuredOutputsParams(grammar=ONLY_PAST_THE_MODEL),
        StructuredOutputsParams(regex="ab(c|d)"),
        StructuredOutputsParams(regex="ab"),
    ]
    states = compiled_states(manager, params)
    a, b = _ids("ab")
    rows = _rows(manager, manager.fill_bitmask(states, [[a, b]] * 3)).reshape(3, 3, -1)
    dead, going_on, complete = rows
    assert dead.all() and states[0].failure is not None
    assert "cannot go on with a token the model can emit" in states[0].failure
    assert going_on[0, a] and going_on[1, b] and states[1].failure is None
    assert going_on[2, _ids("c")[0]] and going_on[2, _ids("d")[0]]
    assert not going_on.all(axis=1).any()  # masks, not the rows that allow everything
    assert complete[0, a] and complete[1, b] and complete[2].all() and states[2].failure is None
    for state in states:  # the fill rolled the drafts back
        assert state.matcher is not None and state.matcher.validate_tokens([a, b]) == 2


def test_a_bad_eos_id_or_tokenizer_still_fails_the_clients_requests_by_name(
    tokenizer_json: str,
) -> None:
    """The widening keeps llguidance's own checks: an eos id past the tokenizer's ids and a
    tokenizer that is not JSON fail the client's constrained requests, naming why."""
    for tokenizer, eos, expected in (
        (tokenizer_json, [PADDED], "EOS token ID 3072 is out of range"),
        ("{not json", [IM_END_ID], "cannot be used for structured outputs"),
    ):
        manager = _manager(tokenizer, NARROW, eos)
        state = StructuredOutputRequest(StructuredOutputsParams(regex="a"))
        assert manager.submit(1, 1, state, []) is None
        deadline = time.monotonic() + 20
        failed: list[tuple[int, str]] = []
        while not failed and time.monotonic() < deadline:
            failed = manager.take_compiled(time.monotonic())[1]
            time.sleep(0.01)
        assert failed and failed[0][1].startswith("structured_outputs.tokenizer:"), failed
        assert expected in failed[0][1]

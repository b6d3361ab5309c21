"""The incremental detokenizer: streamed text always equals decoding the whole output."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frontend_svc.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, backend_decoder

TEXTS = [
    "plain words and more words",
    "caf\u00e9 na\u00efve \u00fcber",
    "\u4e2d\u6587\u5b57",
    "emoji \U0001f600\U0001f680 end",
    "mixed \u00e9\u4e2d\U0001f600x",
]


def stream(tokenizer: Any, ids: list[int], chunks: list[int], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(backend_decoder(tokenizer), skip_special_tokens=skip)
    pieces, start = [], 0
    for size in chunks:
        if start >= len(ids):
            break
        pieces.append(detok.step(ids[start : start + size]))
        start += size
    if start < len(ids):
        pieces.append(detok.step(ids[start:]))
    pieces.append(detok.flush())
    return pieces


def test_multibyte_text_streams_without_broken_characters(tokenizer: Any) -> None:
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        pieces = stream(tokenizer, ids, [1] * len(ids))
        assert "".join(pieces) == text
        assert all(REPLACEMENT_CHAR not in p for p in pieces), pieces
        assert len(ids) > len(text.split())  # the byte-level BPE really splits characters


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_concatenation_equals_full_decode(tokenizer: Any, data: st.DataObject) -> None:
    vocab = len(tokenizer)
    ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40))
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=40))
    skip = data.draw(st.booleans())
    pieces = stream(tokenizer, ids, chunks, skip)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_special_tokens_skipped_or_kept(tokenizer: Any) -> None:
    ids = tokenizer.encode("hello world", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert "".join(stream(tokenizer, ids, [1] * len(ids), skip=True)) == "hello world"
    kept = "".join(stream(tokenizer, ids, [1] * len(ids), skip=False))
    assert kept == "hello world" + tokenizer.eos_token


def test_incomplete_character_is_held_until_complete(tokenizer: Any) -> None:
    ids = tokenizer.encode("\U0001f600", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(backend_decoder(tokenizer))
    assert [detok.step([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.step(ids[-1:]) == "\U0001f600"

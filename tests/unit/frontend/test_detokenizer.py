"""The incremental detokenizer: streamed text always equals decoding the whole output, through
tokenizers' DecodeStream and through the windowed fallback alike."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, trainers

from frontend_svc.engine import detokenizer
from frontend_svc.engine.detokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    backend_decoder,
)
from splitserve_contracts.sampling_types import SamplingParams
from tests.unit.frontend.test_output_processor import run, text_of

TEXTS = [
    "plain words and more words",
    "caf\u00e9 na\u00efve \u00fcber",
    "\u4e2d\u6587\u5b57",
    "emoji \U0001f600\U0001f680 end",
    "mixed \u00e9\u4e2d\U0001f600x",
]


def stream(
    tokenizer: Any, ids: list[int], chunks: list[int], skip: bool = True, use_stream: bool = True
) -> list[str]:
    detok = IncrementalDetokenizer(backend_decoder(tokenizer), skip, use_stream)
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


class DecodeStreamSpy:
    """Wraps tokenizers' DecodeStream (not subclassable) and counts the ids it was given: both
    paths emit the same text, so only this tells which one ran."""

    num_ids = 0

    def __init__(self, **kwargs: Any) -> None:
        self._stream = RealDecodeStream(**kwargs)

    def step(self, tokenizer: Tokenizer, ids: int | list[int]) -> str | None:
        DecodeStreamSpy.num_ids += 1 if isinstance(ids, int) else len(ids)
        return self._stream.step(tokenizer, ids)


RealDecodeStream = detokenizer.DecodeStream


@pytest.fixture
def decode_stream_spy(monkeypatch: pytest.MonkeyPatch) -> type[DecodeStreamSpy]:
    DecodeStreamSpy.num_ids = 0
    monkeypatch.setattr(detokenizer, "DecodeStream", DecodeStreamSpy)
    return DecodeStreamSpy


@pytest.mark.parametrize("use_stream", [True, False])
def test_multibyte_text_streams_without_broken_characters(
    tokenizer: Any, use_stream: bool, decode_stream_spy: type[DecodeStreamSpy]
) -> None:
    num_ids = 0
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        pieces = stream(tokenizer, ids, [1] * len(ids), use_stream=use_stream)
        assert "".join(pieces) == text
        assert all(REPLACEMENT_CHAR not in p for p in pieces), pieces
        assert len(ids) > len(text.split())  # the byte-level BPE really splits characters
        num_ids += len(ids)
    assert decode_stream_spy.num_ids == (num_ids if use_stream else 0)


def test_the_frontends_outputs_are_detokenized_by_decode_stream(
    tokenizer: Any, decode_stream_spy: type[DecodeStreamSpy]
) -> None:
    """The OutputProcessor (what every request goes through) takes the DecodeStream path for
    every token of a fast tokenizer: the windows are only its fallback."""
    ids = tokenizer.encode("caf\u00e9 \U0001f600 streams on", add_special_tokens=False)
    deltas, _ = run(tokenizer, SamplingParams(), ids, None)
    assert text_of(deltas) == "caf\u00e9 \U0001f600 streams on"
    assert decode_stream_spy.num_ids == len(ids)
    assert not deltas[-1].is_finished  # still running: nothing was flushed by the windows


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_concatenation_equals_full_decode(tokenizer: Any, data: st.DataObject) -> None:
    vocab = len(tokenizer)
    ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40))
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=40))
    skip = data.draw(st.booleans())
    use_stream = data.draw(st.booleans())
    pieces = stream(tokenizer, ids, chunks, skip, use_stream)
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


@pytest.fixture(scope="module")
def byte_fallback() -> Tokenizer:
    """A Llama-2-style tokenizer: BPE with byte fallback (<0xNN> tokens), "\u2581" for spaces,
    a decoder that strips the sequence's leading space. On invalid UTF-8 byte runs DecodeStream
    raises ("Invalid prefix encountered"), which the detokenizer must absorb."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        + [decoders.Strip(" ", 1, 0)]
    )
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, limit_alphabet=100)
    tok.train_from_iterator([" ".join(TEXTS)] * 20, trainer)
    return tok


def test_byte_fallback_text_streams_exactly(
    byte_fallback: Tokenizer, decode_stream_spy: type[DecodeStreamSpy]
) -> None:
    num_ids = 0
    for text in TEXTS:
        ids = byte_fallback.encode(text).ids
        pieces = stream(byte_fallback, ids, [1] * len(ids))
        assert "".join(pieces) == byte_fallback.decode(ids) == text
        num_ids += len(ids)
    assert decode_stream_spy.num_ids == num_ids  # valid UTF-8: DecodeStream all the way


def test_invalid_byte_runs_fall_back_to_windows_with_the_same_output(
    byte_fallback: Tokenizer,
) -> None:
    """Random ids make invalid UTF-8 byte runs: DecodeStream gives up on some, the request goes
    on with windows, and every piece equals what the windowed decoder alone streams."""
    rng = random.Random(0)
    num_fell_back = 0
    for _ in range(400):
        ids = [rng.randrange(byte_fallback.get_vocab_size()) for _ in range(rng.randint(1, 30))]
        chunks = [rng.randint(1, 4) for _ in ids]
        skip = rng.random() < 0.5
        detok = IncrementalDetokenizer(byte_fallback, skip)
        pieces, start = [], 0
        for size in chunks:
            if start < len(ids):
                pieces.append(detok.step(ids[start : start + size]))
                start += size
        pieces.append(detok.flush())
        num_fell_back += detok._stream is None
        assert pieces == stream(byte_fallback, ids, chunks, skip, use_stream=False)
    assert num_fell_back > 0  # the fallback really ran


def test_a_tokenizer_without_decode_stream_uses_windows(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer)  # the HF wrapper, not a tokenizers.Tokenizer
    ids = tokenizer.encode("caf\u00e9 \U0001f600", add_special_tokens=False)
    assert detok._stream is None
    assert "".join(detok.step([i]) for i in ids) + detok.flush() == "caf\u00e9 \U0001f600"

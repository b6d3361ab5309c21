"""The grammar bitmask on the wire, core to rank: the core's encoding (dense, or sparse when
smaller: core_svc/structured_output/structured_bitmask.py) decodes on the rank to the same allowed tokens for every
kind of row, the rank's masked logits equal those of the dense form, and a malformed sparse mask
is refused with a reason."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from core_svc import convert as core_convert
from core_svc.sched.scheduler_output import GrammarBitmask, SchedulerOutput
from core_svc.structured_output.structured_bitmask import sparse_bitmask
from splitserve_contracts.worker.v1 import worker_service_pb2 as pb
from worker_svc import convert as worker_convert
from worker_svc.kernels.cpu_kernels import CpuKernels
from worker_svc.sample.grammar_bitmask import apply_grammar_bitmask, grammar_bitmask_from_bytes
from worker_svc.scheduler_output import GrammarBitmask as RankGrammarBitmask
from worker_svc.step_checks import MalformedStep

KINDS = ("all_allowed", "none_allowed", "few_allowed", "string_like", "random")


def mask_rows(kinds: list[str], vocab_size: int, seed: int) -> np.ndarray:
    """One packed row per kind: every token, none, a handful (between JSON keys), all but a
    scattered few (inside a string), or random words (no majority: a partial row)."""
    rng = np.random.default_rng(seed)
    allowed = np.zeros((len(kinds), vocab_size), bool)
    for row, kind in enumerate(kinds):
        if kind == "all_allowed":
            allowed[row] = True
        elif kind == "few_allowed":
            allowed[row, rng.choice(vocab_size, 5, replace=False)] = True
        elif kind == "string_like":
            allowed[row] = True
            allowed[row, rng.choice(vocab_size, 300, replace=False)] = False
        elif kind == "random":
            allowed[row] = rng.random(vocab_size) < 0.5
    num_words = (vocab_size + 31) // 32
    padded = np.zeros((len(kinds), 32 * num_words), bool)
    padded[:, :vocab_size] = allowed
    padded[[k == "all_allowed" for k in kinds], vocab_size:] = True  # as the core fills them
    return np.packbits(padded, axis=1, bitorder="little").view("<i4")


def over_the_wire(
    handles: list[int], words: np.ndarray
) -> tuple[pb.GrammarBitmask, RankGrammarBitmask | None]:
    """Core encoding, serialized and parsed as the rank receives it, then the rank's decoding."""
    step = SchedulerOutput(step_id=4, grammar_bitmask=GrammarBitmask(handles, words.tobytes()))
    wire = core_convert.grammar_output_to_proto(step).SerializeToString()
    received = pb.ExecuteRequest.FromString(wire).grammar_output
    assert received.step_id == 4
    return received.grammar_bitmask, worker_convert.grammar_bitmask_from_proto(
        received.grammar_bitmask
    )


def allowed_tokens(words: np.ndarray, vocab_size: int) -> np.ndarray:
    bits = np.unpackbits(np.ascontiguousarray(words).view(np.uint8), axis=1, bitorder="little")
    return bits[:, :vocab_size].astype(bool)


@pytest.mark.parametrize("vocab_size", [32000, 49155])
def test_every_row_kind_round_trips_through_the_sparse_form(vocab_size: int) -> None:
    kinds = [*KINDS[:4]] * 8  # batch 32, no random rows: sparse is far smaller
    words = mask_rows(kinds, vocab_size, seed=vocab_size)
    handles = list(range(100, 132))
    msg, decoded = over_the_wire(handles, words)
    assert msg.HasField("sparse") and not msg.bitmask
    assert msg.ByteSize() < words.nbytes / 5
    assert decoded is not None
    assert decoded.req_handles.tolist() == handles
    assert np.array_equal(
        allowed_tokens(decoded.bitmask, vocab_size), allowed_tokens(words, vocab_size)
    )
    assert decoded.all_allowed is not None
    assert decoded.all_allowed.tolist() == [k == "all_allowed" for k in kinds]


def test_the_dense_form_stays_where_sparse_would_not_be_smaller() -> None:
    words = mask_rows(["random", "few_allowed"] * 16, 32000, seed=1)
    msg, decoded = over_the_wire(list(range(32)), words)
    assert msg.bitmask == words.tobytes() and not msg.HasField("sparse")
    assert decoded is not None and np.array_equal(decoded.bitmask, words)
    small = mask_rows(["few_allowed"], 32000, seed=2)  # batch 1: 4 KB, below the threshold
    msg, _ = over_the_wire([7], small)
    assert msg.bitmask == small.tobytes() and not msg.HasField("sparse")
    assert sparse_bitmask(small, min_dense_bytes=0) is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rank_masks_the_logits_exactly_as_the_dense_form_does(
    dtype: torch.dtype, kernels: CpuKernels | None
) -> None:
    """Drafts repeat a handle (its k-th mask row goes to its k-th logits row): an all-allowed
    row between two others must not shift them. A row of a handle not sampling is ignored."""
    vocab_size = 1000
    kinds = ["few_allowed", "all_allowed", "string_like", "all_allowed", "none_allowed"] * 4
    words = mask_rows(kinds, vocab_size, seed=3)
    handles = [9, 9, 9, 4, 5] + [20 + i for i in range(15)]
    sampling = np.array([5, 9, 9, 9, 4, *range(20, 34)], np.int64)  # 34 does not sample
    step = SchedulerOutput(step_id=1, grammar_bitmask=GrammarBitmask(handles, words.tobytes()))
    msg = core_convert.grammar_output_to_proto(step).grammar_output.grammar_bitmask
    msg.ClearField("bitmask")
    sparse = sparse_bitmask(words, min_dense_bytes=0)
    assert sparse is not None
    msg.sparse.num_words = sparse.num_words
    msg.sparse.row_defaults = sparse.row_defaults
    msg.sparse.num_listed_words.extend(sparse.num_listed_words)
    msg.sparse.word_indices = sparse.word_indices
    msg.sparse.words = sparse.words
    decoded = worker_convert.grammar_bitmask_from_proto(msg)
    dense = grammar_bitmask_from_bytes(handles, words.tobytes())
    assert decoded is not None and dense is not None and decoded.all_allowed is not None
    logits = torch.randn(len(sampling), vocab_size).to(dtype)
    expected = logits.clone()
    apply_grammar_bitmask(expected, sampling, dense, kernels)
    apply_grammar_bitmask(logits, sampling, decoded, kernels)
    assert torch.equal(logits, expected)
    assert torch.isinf(expected).any() and not torch.isinf(expected[2]).any()  # 9's 2nd: all


def malformed(**changes: object) -> pb.GrammarBitmask:
    words = mask_rows(["few_allowed", "all_allowed"], 3200, seed=4)
    sparse = sparse_bitmask(words, min_dense_bytes=0)
    assert sparse is not None
    msg = pb.GrammarBitmask(req_handles=[1, 2])
    msg.sparse.num_words = sparse.num_words
    msg.sparse.row_defaults = sparse.row_defaults
    msg.sparse.num_listed_words.extend(sparse.num_listed_words)
    msg.sparse.word_indices = sparse.word_indices
    msg.sparse.words = sparse.words
    for name, value in changes.items():
        if name == "bitmask":
            msg.bitmask = value  # type: ignore[assignment]
        elif name == "word_indices":  # the first index past the row
            msg.sparse.word_indices = b"\xff" * 4 + msg.sparse.word_indices[4:]
        elif name == "num_listed_words":
            msg.sparse.ClearField("num_listed_words")
            msg.sparse.num_listed_words.extend(value)  # type: ignore[arg-type]
        else:
            setattr(msg.sparse, name, value)
    return msg


def test_a_well_formed_sparse_mask_decodes() -> None:
    assert worker_convert.grammar_bitmask_from_proto(malformed()) is not None


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"num_words": 0}, "words per row"),
        ({"num_words": 2**31}, "words per row"),
        ({"row_defaults": b"\x00"}, "row_defaults"),
        ({"row_defaults": b"\x00\x02"}, "not 0 or 1"),
        ({"num_listed_words": [1]}, "num_listed_words"),
        ({"num_listed_words": [1000, 0]}, "listed words"),
        ({"words": b"\x00" * 3}, "listed words"),
        ({"word_indices": None}, "past its row"),
        ({"bitmask": b"\x00" * 80}, "both"),
    ],
)
def test_a_malformed_sparse_mask_is_refused_with_its_reason(
    changes: dict[str, object], reason: str
) -> None:
    msg = malformed(**changes)
    with pytest.raises(MalformedStep, match=reason):
        worker_convert.grammar_bitmask_from_proto(msg)

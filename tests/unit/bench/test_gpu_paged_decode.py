"""The GPU decode benchmark's smoke mode: tiny shapes on the CPU, so the script keeps working."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from benchmarks.gpu.paged_decode import decode_inputs, main, prefill_inputs


def test_decode_inputs_put_each_request_in_its_own_blocks() -> None:
    inputs = decode_inputs(batch=3, context=40, block_size=16)
    assert inputs.block_tables.shape == (3, 3)
    assert len(np.unique(inputs.block_tables)) == 9 and inputs.block_tables.min() >= 1
    for row, slot in zip(inputs.block_tables, inputs.slot_mapping, strict=True):
        assert slot // 16 == row[2] and slot % 16 == 39 % 16
    prefill = prefill_inputs(inputs)
    assert prefill.num_tokens == 3 * 39 and list(prefill.seq_lens) == [39, 39, 39]
    assert not set(prefill.slot_mapping) & set(inputs.slot_mapping)


def test_smoke_run_checks_and_times_every_part(tmp_path: Path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the torch backend only
    out = tmp_path / "paged_decode.json"
    main(["--smoke", "--out", str(out)])
    rows = json.loads(out.read_text())
    assert [r["part"] for r in rows] == ["check", "attention", "decode_step"]
    check, attention, step = rows
    assert check["backend"] == "torch" and check["max_abs_error_vs_torch"] == 0.0
    assert attention["us"] > 0 and attention["batch"] == 2 and attention["context"] == 40
    assert step["eager_ms"] > 0 and step["graph_ms"] is None
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed[0]["part"] == "machine" and printed[1:] == rows

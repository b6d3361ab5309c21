"""Every stop condition, checked by the engine core after each sampled token."""

from __future__ import annotations

from typing import Any

from core_svc.outputs import EngineCoreOutput
from core_svc.request import RequestStatus
from core_svc.sched.stop_check import check_stop
from splitserve_contracts.output_types import FinishReason
from tests.unit.core.fake_executor import make_engine, make_request, run_to_completion

EOS = 2


def run_script(
    script: list[int], max_model_len: int = 256, **sampling: Any
) -> tuple[list[int], EngineCoreOutput]:
    """Generate with a scripted token sequence; returns (tokens, final detail)."""
    engine, executor = make_engine(max_model_len=max_model_len)
    request = make_request(1, [10, 11, 12], eos_token_id=EOS, request_id="r", **sampling)
    executor.scripts["r"] = script
    engine.add_request(request)
    view = run_to_completion(engine)
    final = view.details[(1, 1)][-1]
    assert engine.make_stats().kv_cache_usage == 0.0
    return view.tokens[(1, 1)], final


def test_eos_stops_without_stop_reason() -> None:
    tokens, final = run_script([5, 6, EOS, 7], max_tokens=10)
    assert tokens == [5, 6, EOS]
    assert final.finish_reason == FinishReason.STOP
    assert final.stop_token_id is None


def test_ignore_eos_keeps_generating() -> None:
    tokens, final = run_script([5, EOS, 7], max_tokens=4, ignore_eos=True)
    assert tokens[:3] == [5, EOS, 7] and len(tokens) == 4
    assert final.finish_reason == FinishReason.LENGTH


def test_min_tokens_gates_eos_and_stop_token_ids() -> None:
    tokens, final = run_script([EOS, 9, 5, 9], max_tokens=10, min_tokens=3, stop_token_ids=(9,))
    assert tokens == [EOS, 9, 5, 9]
    assert final.finish_reason == FinishReason.STOP
    assert final.stop_token_id == 9


def test_stop_token_id_is_reported() -> None:
    tokens, final = run_script([5, 77, 6], max_tokens=10, stop_token_ids=(77, 78))
    assert tokens == [5, 77]
    assert final.finish_reason == FinishReason.STOP
    assert final.stop_token_id == 77


def test_eos_that_is_also_a_stop_token_reports_eos() -> None:
    _, final = run_script([EOS], max_tokens=10, stop_token_ids=(EOS,))
    assert final.finish_reason == FinishReason.STOP and final.stop_token_id is None


def test_max_tokens_caps_length() -> None:
    tokens, final = run_script([5, 6, 7, 8], max_tokens=3)
    assert tokens == [5, 6, 7]
    assert final.finish_reason == FinishReason.LENGTH


def test_unset_max_tokens_runs_to_max_model_len() -> None:
    tokens, final = run_script([5] * 20, max_model_len=10, max_tokens=None)
    assert len(tokens) == 10 - 3
    assert final.finish_reason == FinishReason.LENGTH


def test_max_model_len_caps_even_an_explicit_max_tokens() -> None:
    tokens, final = run_script([5] * 20, max_model_len=8, max_tokens=100)
    assert len(tokens) == 5
    assert final.finish_reason == FinishReason.LENGTH


def test_length_caps_apply_before_min_tokens() -> None:
    tokens, final = run_script([5] * 20, max_tokens=2, min_tokens=5)
    assert len(tokens) == 2
    assert final.finish_reason == FinishReason.LENGTH


def test_eos_at_the_length_cap_is_a_stop() -> None:
    tokens, final = run_script([5, EOS], max_tokens=2)
    assert tokens == [5, EOS]
    assert final.finish_reason == FinishReason.STOP


def test_check_stop_on_a_bare_request() -> None:
    request = make_request(1, [1, 2], eos_token_id=EOS, max_tokens=5)
    request.resolve_max_tokens(100)
    for token, expected in ((3, False), (EOS, True)):
        request.output_token_ids.append(token)
        request.all_token_ids.append(token)
        assert check_stop(request, max_model_len=100) is expected
    assert request.status == RequestStatus.FINISHED_STOPPED

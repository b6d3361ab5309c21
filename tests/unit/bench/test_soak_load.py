"""The soak's verdict on an HTTP stream: only a stream that finished counts as served; one that
carried an error event (sent after the 200 status) or stopped early is an unexpected outcome."""

from __future__ import annotations

import json

from benchmarks.soak_load import EXPECTED, sse_problem


def _sse(*events: object) -> bytes:
    lines = [f"data: {json.dumps(e)}" if not isinstance(e, str) else f"data: {e}" for e in events]
    return ("\n\n".join(lines) + "\n\n").encode()


CHUNK = {"choices": [{"delta": {"content": "hi"}, "finish_reason": None}]}
LAST = {"choices": [{"delta": {}, "finish_reason": "length"}]}
ERROR = {"error": {"message": "lost the engine core; retry the request", "code": 503}}


def test_a_stream_that_finished_is_served() -> None:
    assert sse_problem(_sse(CHUNK, LAST, "[DONE]")) == ""
    assert "http_chat_stream" + sse_problem(_sse(CHUNK, LAST, "[DONE]")) in EXPECTED


def test_an_error_event_is_a_failure_even_when_the_stream_ends_with_done() -> None:
    outcome = "http_chat_stream" + sse_problem(_sse(CHUNK, ERROR, "[DONE]"))
    assert outcome == "http_chat_stream_error: lost the engine core; retry the request"
    assert outcome not in EXPECTED


def test_a_stream_without_a_finish_reason_or_done_is_unfinished() -> None:
    assert sse_problem(_sse(CHUNK, "[DONE]")) == "_unfinished"
    assert sse_problem(_sse(CHUNK, LAST)) == "_unfinished"
    assert sse_problem(b"") == "_unfinished"

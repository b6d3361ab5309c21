"""Wave 3's HTTP surfaces under the hostile probe's input (tests/reliability/surface_cases.py),
over real processes on loopback: each refusal gets its status and OpenAI's error JSON naming the
field at fault; each accepted edge is served as vLLM serves it; after every case the stack still
serves and nothing leaked."""

from __future__ import annotations

import pytest

from tests.e2e.stack import Stack
from tests.reliability.http_cases import HttpCase
from tests.reliability.http_probes import (
    assert_http_serving_and_idle,
    assert_refused_and_serving,
    case_body,
    post_json,
)
from tests.reliability.surface_cases import ACCEPTED, REFUSED

pytestmark = pytest.mark.slow


def test_the_table_covers_every_surface() -> None:
    paths = {c.path.split("/resp_")[0] for c in REFUSED}
    assert len(REFUSED) >= 40 and len({c.id for c in REFUSED}) == len(REFUSED)
    assert {"/v1/responses", "/v1/load_lora_adapter", "/v1/embeddings", "/classify"} <= paths


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: c.id)
def test_bad_surface_input_is_refused_by_name_and_the_engine_keeps_serving(
    shared_stack: Stack, case: HttpCase
) -> None:
    assert_refused_and_serving(shared_stack, case, case_body(case))


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_surface_edges_vllm_accepts_are_served(shared_stack: Stack, name: str) -> None:
    path, body = ACCEPTED[name]
    status, reply = post_json(shared_stack.http, path, body)
    assert status == 200, reply
    (choice,) = reply["choices"]
    assert choice["finish_reason"] in ("stop", "length", "tool_calls"), choice
    if name == "guided-choice-legacy-field":  # the constraint held
        assert choice["text"] in ("yes", "no"), choice
    assert_http_serving_and_idle(shared_stack)

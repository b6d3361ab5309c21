"""A model whose end-of-sequence ids lie past its embedding rows is served, end to end over real
processes. transformers' Qwen2Tokenizer adds `<|endoftext|>` after its BPE, at id 3,000 of a
model of config.vocab_size 3,000 (tests/fixtures/qwen2_vocab.py): as a base Qwen2's EOS (the
tokenizer's, so the request's eos_token_id) or, as Qwen2-Instruct lists it, the generation
config's second EOS (a stop token id the frontend adds). The model can never sample such an id,
so it can never end a request: it is dropped, not refused, min_tokens included (vLLM serves
these requests too). A client's own stop_token_ids, allowed_token_ids and logit_bias past the
vocabulary stay a 400, as vLLM's SamplingParams.verify refuses them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.stack import Stack
from tests.fixtures.qwen2_vocab import (
    ENDOFTEXT_ID,
    IM_END_ID,
    NUM_BPE_TOKENS,
    make_qwen2_checkpoint,
)
from tests.reliability.http_probes import (
    assert_http_serving_and_idle,
    assert_openai_error,
    post_json,
)

pytestmark = pytest.mark.slow
CHECKPOINTS = {
    "base": ("<|endoftext|>", ENDOFTEXT_ID),
    "instruct": ("<|im_end|>", [IM_END_ID, ENDOFTEXT_ID]),
}
CHAT = [{"role": "user", "content": "Name a red city."}]


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def eos_stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Stack]]:
    eos_token, eos_token_id = CHECKPOINTS[request.param]
    folder = tmp_path_factory.mktemp(f"qwen2-eos-{request.param}") / "qwen2"
    make_qwen2_checkpoint(folder, NUM_BPE_TOKENS, eos_token, eos_token_id)
    stack = Stack(folder).start()
    yield request.param, stack
    stack.stop()


def _served(stack: Stack, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, reply = post_json(stack.http, path, {**body, "seed": 0})
    assert status == 200, reply
    return dict(reply)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_plain_and_min_tokens_requests_are_served(eos_stack: tuple[str, Stack], path: str) -> None:
    name, stack = eos_stack
    prompt: dict[str, Any] = (
        {"prompt": "red city"} if path == "/v1/completions" else {"messages": CHAT}
    )
    for extra in ({}, {"min_tokens": 6}, {"ignore_eos": True}):
        reply = _served(stack, path, {**prompt, "max_tokens": 8, **extra})
        (choice,) = reply["choices"]
        num_tokens = reply["usage"]["completion_tokens"]
        assert choice["finish_reason"] in ("stop", "length"), reply
        assert num_tokens >= extra.get("min_tokens", 1), reply
        if name == "base" or "ignore_eos" in extra:  # no EOS the model can sample
            assert (choice["finish_reason"], num_tokens) == ("length", 8), reply
    assert_http_serving_and_idle(stack)


@pytest.mark.parametrize(
    "sampling",
    [
        {"stop_token_ids": [ENDOFTEXT_ID]},
        {"allowed_token_ids": [5, ENDOFTEXT_ID]},
        {"logit_bias": {str(ENDOFTEXT_ID): 1.0}},
    ],
    ids=["stop_token_ids", "allowed_token_ids", "logit_bias"],
)
def test_a_clients_ids_past_the_vocabulary_are_still_a_400(
    eos_stack: tuple[str, Stack], sampling: dict[str, Any]
) -> None:
    _, stack = eos_stack
    body = {"prompt": "red city", "max_tokens": 4, "min_tokens": 2, **sampling}
    status, reply = post_json(stack.http, "/v1/completions", body)
    error = assert_openai_error(reply, 400)
    assert status == 400 and "outside the vocabulary" in error["message"], error
    assert error["param"] == next(iter(sampling)), error
    assert f"{ENDOFTEXT_ID}" in error["message"] and "0..2999" in error["message"], error
    assert_http_serving_and_idle(stack)

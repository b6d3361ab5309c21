"""InputProcessor: tokenization as vLLM does it, and INVALID_ARGUMENT-worthy messages."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from frontend_svc.errors import InvalidRequest
from frontend_svc.inputs.input_processor import InputProcessor
from frontend_svc.requests import ChatTurn, GenerateInput, PromptInput
from splitserve_contracts.sampling_rules import Limits
from splitserve_contracts.sampling_types import SamplingParams

MAX_LEN = 64


@pytest.fixture()
def inputs(tokenizer: Any) -> InputProcessor:
    return InputProcessor(tokenizer, MAX_LEN, Limits(vocab_size=len(tokenizer)), extra_eos_ids=(5,))


def call(prompt: PromptInput, **params: Any) -> GenerateInput:
    return GenerateInput("r1", prompt, SamplingParams(**params))


def test_text_gets_default_special_tokens(inputs: InputProcessor, tokenizer: Any) -> None:
    req = inputs.process(call(PromptInput(text="hello world")))
    assert req.prompt_token_ids[0] == tokenizer.bos_token_id
    assert req.prompt_token_ids[1:] == tokenizer.encode("hello world", add_special_tokens=False)
    assert req.params.max_tokens == MAX_LEN - len(req.prompt_token_ids)
    assert req.eos_token_id == tokenizer.eos_token_id
    assert 5 in req.params.stop_token_ids


def test_ignore_eos_keeps_generation_config_eos_out(inputs: InputProcessor) -> None:
    req = inputs.process(call(PromptInput(text="hi"), ignore_eos=True))
    assert 5 not in req.params.stop_token_ids


def test_model_eos_ids_past_the_vocabulary_go_on_a_clients_are_refused(tokenizer: Any) -> None:
    """The generation config's EOS ids are the model's: one past the embedding rows (an added
    token, as Qwen2Tokenizer's <|endoftext|>) is not the client's fault and goes on, for the
    engine core to drop (it can never be sampled); a client's own stop_token_ids past the
    vocabulary are refused naming the field, as vLLM's SamplingParams.verify does."""
    vocab_size = len(tokenizer)
    inputs = InputProcessor(
        tokenizer, MAX_LEN, Limits(vocab_size=vocab_size), extra_eos_ids=(vocab_size,)
    )
    req = inputs.process(call(PromptInput(text="hi"), min_tokens=2))
    assert vocab_size in req.params.stop_token_ids
    with pytest.raises(InvalidRequest) as err:
        inputs.process(call(PromptInput(text="hi"), stop_token_ids=(vocab_size,)))
    assert err.value.param == "sampling_params.stop_token_ids"
    assert f"stop_token_ids[0] = {vocab_size} is outside the vocabulary" in str(err.value)


def test_chat_is_rendered_with_the_template(inputs: InputProcessor, tokenizer: Any) -> None:
    chat = (ChatTurn("user", "hi there"),)
    req = inputs.process(call(PromptInput(chat=chat)))
    text = tokenizer.decode(req.prompt_token_ids)
    assert text == tokenizer.bos_token + "user: hi there\nassistant: "
    assert req.prompt_token_ids.count(tokenizer.bos_token_id) == 1


@pytest.mark.parametrize(
    ("prompt", "params", "needle"),
    [
        (PromptInput(text=""), {}, "prompt is empty"),
        (PromptInput(token_ids=()), {}, "prompt_token_ids is empty"),
        (PromptInput(), {}, "no prompt given"),
        (PromptInput(chat=()), {}, "chat has no messages"),
        (PromptInput(token_ids=(1, 99999)), {}, "prompt_token_ids[1] = 99999 is outside"),
        (PromptInput(token_ids=tuple(range(3, 3 + MAX_LEN))), {}, "max_model_len is 64"),
        (PromptInput(text="hi"), {"max_tokens": 100}, "set max_tokens to at most"),
        (PromptInput(text="hi"), {"max_tokens": 0}, "max_tokens must be >= 1"),
        (PromptInput(text="hi"), {"n": 2, "temperature": 0.0}, "identical"),
        (PromptInput(text="hi"), {"temperature": -1.0}, "temperature must be finite and >= 0"),
        (PromptInput(text="hi"), {"top_p": 0.0}, "top_p must be in (0, 1]"),
        (PromptInput(text="hi"), {"top_k": -2}, "top_k"),
        (PromptInput(text="hi"), {"min_p": 1.5}, "min_p"),
        (PromptInput(text="hi"), {"presence_penalty": 3.0}, "presence_penalty"),
        (PromptInput(text="hi"), {"repetition_penalty": 0.0}, "repetition_penalty"),
        (PromptInput(text="hi"), {"logprobs": 50}, "logprobs must be in [0, 20]"),
        (PromptInput(text="hi"), {"stop": tuple(str(i) for i in range(40))}, "stop strings"),
        (PromptInput(text="hi"), {"stop": ("",)}, "stop[0]"),
        (PromptInput(text="hi"), {"stop_token_ids": (70000,)}, "stop_token_ids[0]"),
        (PromptInput(text="hi"), {"logit_bias": {70000: 1.0}}, "logit_bias"),
        (PromptInput(text="hi"), {"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        (PromptInput(text="hi"), {"min_tokens": 2**32 - 1}, "lower min_tokens"),
        (PromptInput(text="x" * 10**6), {}, "more than any prompt that fits"),
        (PromptInput(chat=(ChatTurn("user", "y" * 10**6),)), {}, "more than any prompt"),
    ],
)
def test_invalid_requests_say_what_to_change(
    inputs: InputProcessor, prompt: PromptInput, params: dict[str, Any], needle: str
) -> None:
    with pytest.raises(InvalidRequest) as err:
        inputs.process(call(prompt, **params))
    assert needle in str(err.value)


def test_greedy_disables_filters_and_bias_is_clamped(inputs: InputProcessor) -> None:
    req = inputs.process(
        call(PromptInput(text="hi"), temperature=0.0, top_p=0.5, top_k=3, logit_bias={7: 500.0})
    )
    assert (req.params.top_p, req.params.top_k) == (1.0, 0)
    assert req.params.logit_bias == {7: 100.0}


def test_oversized_ids_and_salts_are_refused_by_name(inputs: InputProcessor) -> None:
    with pytest.raises(InvalidRequest) as err:
        inputs.process(GenerateInput("r" * 300, PromptInput(text="hi"), SamplingParams()))
    assert err.value.param == "request_id"
    with pytest.raises(InvalidRequest) as err:
        inputs.process(GenerateInput("r", PromptInput(text="hi"), SamplingParams(), 0, "s" * 300))
    assert err.value.param == "cache_salt"


def test_top_k_above_the_vocabulary_is_clamped(inputs: InputProcessor, tokenizer: Any) -> None:
    req = inputs.process(call(PromptInput(text="hi"), top_k=10**6))
    assert req.params.top_k == len(tokenizer)


def test_tokenizer_work_runs_off_the_event_loop(inputs: InputProcessor) -> None:
    """A long tokenization must not stall the loop's other streams (issue 11, item 4: a 5 MB
    prompt froze every stream for 7 s)."""
    gate = threading.Event()

    async def main() -> tuple[int, int, list[int]]:
        loop_thread = threading.get_ident()
        blocked = asyncio.ensure_future(inputs.run(gate.wait, 60))  # a tokenization that hangs
        other = await inputs.run(inputs.tokenize, PromptInput(text="hi"))  # others still run
        worker_thread = await inputs.run(threading.get_ident)
        gate.set()
        assert await blocked
        return loop_thread, worker_thread, other.token_ids

    loop_thread, worker_thread, token_ids = asyncio.run(main())
    assert worker_thread != loop_thread and token_ids

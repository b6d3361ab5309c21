"""The offline `LLM` API: the same outputs as the served engine; TP=2 spawns and stops its
worker and core processes; `import splitserve` starts nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from splitserve_contracts.core.v1 import core_service_pb2 as core_pb2
from splitserve_contracts.core.v1 import core_service_pb2_grpc as core_grpc
from tests.e2e.stack import Stack
from tests.e2e.test_generate import PROMPT

pytestmark = pytest.mark.slow
PROMPTS = [PROMPT, "Hello there", "A B C"]


def served(stack: Stack, prompt: str, **kwargs: Any) -> openai.types.Completion:
    sdk = openai.OpenAI(base_url=f"{stack.http}/v1", api_key="x", max_retries=0)
    return sdk.completions.create(model="tiny-llama-v1", prompt=prompt, **kwargs)


def test_generate_and_chat_equal_the_served_output(stack: Stack, tiny_model_dir: Path) -> None:
    from splitserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(str(tiny_model_dir), kv_cache_memory_bytes=64 << 20) as llm:
        outputs = llm.generate(PROMPTS, params)
        chat = llm.chat([{"role": "user", "content": "hi"}], params)[0]
        sampled = llm.generate(PROMPT, SamplingParams(temperature=0.8, seed=3, max_tokens=8, n=2))
        stopped = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, stop=["4"]))
        scored = llm.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        # Assembled as the service's engine (core_svc/assembly.py): the scheduler knows the
        # model's vocabulary (the in-process engine once built its own SchedulerConfig without).
        assert llm._inprocess is not None
        scheduler_config = llm._inprocess.proc.engine_core.scheduler_config
        assert scheduler_config.vocab_size == llm.frontend.info.vocab_size
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        reply = served(
            stack, prompt, max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True}
        )
        assert out.prompt == prompt and out.prompt_token_ids[0] == 0  # BOS
        assert out.outputs[0].text == reply.choices[0].text
        assert len(out.outputs[0].token_ids) == 12 and out.outputs[0].finish_reason == "length"
    sdk = openai.OpenAI(base_url=f"{stack.http}/v1", api_key="x", max_retries=0)
    served_chat = sdk.chat.completions.create(
        model="tiny-llama-v1",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=12,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert chat.outputs[0].text == served_chat.choices[0].message.content
    seeded = served(stack, PROMPT, max_tokens=8, temperature=0.8, seed=3, n=2)
    assert [o.text for o in sampled[0].outputs] == [c.text for c in seeded.choices]
    assert "4" not in stopped[0].outputs[0].text
    # vLLM's RequestOutput.prompt_logprobs: None first, then each prompt token's own logprob
    rows = scored.prompt_logprobs
    assert rows is not None and rows[0] is None
    assert len(rows) == len(scored.prompt_token_ids)
    for token, row in zip(scored.prompt_token_ids[1:], rows[1:], strict=True):
        assert row is not None and list(row) == [token] and row[token] <= 0.0


def test_tp2_llm_starts_and_stops_its_processes(tiny_model_dir: Path, stack: Stack) -> None:
    from splitserve import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), tensor_parallel_size=2, kv_cache_memory_bytes=32 << 20)
    children = [c.process for c in llm._children]
    try:
        assert len(children) == 3 and all(p.poll() is None for p in children)
        with grpc.insecure_channel(llm._children[-1].address) as channel:  # plaintext loopback,
            stub = core_grpc.EngineCoreServiceStub(channel)  # but not open to a stranger
            with pytest.raises(grpc.RpcError) as refused:
                stub.Handshake(core_pb2.HandshakeRequest(), timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        out = llm.generate(
            [PROMPT], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        )
    finally:
        llm.close()
    assert all(p.poll() is not None for p in children)
    reply = served(stack, PROMPT, max_tokens=10, temperature=0.0, extra_body={"ignore_eos": True})
    assert out[0].outputs[0].text == reply.choices[0].text


def test_import_splitserve_is_cheap() -> None:
    code = (
        "import sys, splitserve; "
        "assert splitserve.SamplingParams(max_tokens=3).max_tokens == 3; "
        "print(sorted(m for m in ('torch', 'grpc', 'transformers', 'uvicorn') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

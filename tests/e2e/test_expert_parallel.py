"""`--enable-expert-parallel` end to end: a TP=2 stack serving a tiny Mixtral whose two ranks
each hold two of its four experts, whole, generates what transformers does. The experts'
intermediate size is odd, so only expert parallelism can split them: without the flag reaching
the workers the load would be refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitserve_runtime.tiny_model import write_tokenizer
from tests.e2e.client import generate, text_request
from tests.e2e.stack import Stack
from tests.e2e.test_generate import PROMPT, hf_greedy
from tests.fixtures.checkpoints import VOCAB_SIZE, make_checkpoint

pytestmark = pytest.mark.slow


def test_tp2_expert_parallel_stack_matches_transformers(tmp_path: Path) -> None:
    model = make_checkpoint(tmp_path / "mixtral", "mixtral", seed=3, intermediate_size=63)
    write_tokenizer(model, vocab_size=VOCAB_SIZE)
    from frontend_svc.inputs.input_processor import load_tokenizer

    prompt_ids = load_tokenizer(str(model)).encode(PROMPT)
    stack = Stack(model, tp=2, core_flags=["--enable-expert-parallel"]).start()
    try:
        result = generate(
            stack.frontend, text_request(PROMPT, temperature=0.0, max_tokens=16, ignore_eos=True)
        )[0]
    finally:
        stack.stop()
    import transformers

    # transformers' grouped expert matmul needs 16-byte strides, which 63 columns are not.
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(model), experts_implementation="eager"
    ).eval()
    assert result.token_ids == hf_greedy(reference, prompt_ids, 16)

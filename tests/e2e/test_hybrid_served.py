"""Issue 41's hybrid families served end to end: a random-weight GraniteMoeHybrid (Mamba2 +
attention) and Qwen3-Next (gated DeltaNet + gated attention) checkpoint, built by transformers,
served by the launcher's processes, answer the official `openai` SDK with transformers' greedy
tokens.

The state group bounds the engine: one state slot per request, as many as --max-num-seqs; the
KV cache holds fewer blocks than the concurrent requests need, so some are preempted (their
slot freed, their state recomputed from the first token when they resume); prompts are chunked
(--max-num-batched-tokens below a prompt), so the state layers carry their state across steps.
Prefix caching is off for these models, and the engine says so in vllm:cache_config_info. A
worker rank killed mid-stream is restarted and every stream resumes token for token.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from splitserve_runtime.tiny_model import write_tokenizer
from tests.e2e.stack import Stack
from tests.e2e.test_openai_http import get
from tests.fixtures.checkpoints import VOCAB_SIZE, load_reference
from tests.fixtures.hybrid_checkpoints import make_hybrid_checkpoint
from tests.fixtures.parity import reference_generate
from tests.fixtures.qwen3_next_checkpoint import make_qwen3_next_checkpoint

pytestmark = pytest.mark.slow

BUILDERS: dict[str, Callable[[Path], Path]] = {
    "granite_hybrid": make_hybrid_checkpoint,
    "qwen3_next": make_qwen3_next_checkpoint,
}
PROMPTS = [[(13 * i + 7 * j) % 400 + 3 for j in range(18 + 3 * i)] for i in range(6)]
MAX_TOKENS = 14
NUM_BLOCKS = 8
"""16-token blocks: each request needs 2 or 3, the three that run at once up to 9."""
MAX_NUM_SEQS = 3


def block_bytes(config: dict[str, Any]) -> int:
    """A 16-token float32 KV block of the attention layers (K and V per KV head)."""
    types = config.get("layer_types") or config.get("layers_block_type")
    num_attention = sum(t in ("attention", "full_attention") for t in types)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    return num_attention * 2 * 16 * kv_heads * head_dim * 4


def state_bytes(config: dict[str, Any]) -> int:
    """One request's float32 state over every state layer: Mamba2's convolution inputs
    (conv_dim x (d_conv - 1)) and SSM state (heads x head_dim x d_state); gated DeltaNet's
    convolution inputs over q, k, v and its recurrent state (value heads x dk x dv)."""
    types = config.get("layer_types") or config.get("layers_block_type")
    num_state = sum(t not in ("attention", "full_attention") for t in types)
    if "mamba_n_heads" in config:
        inner = int(config["mamba_expand"] * config["hidden_size"])
        conv_dim = inner + 2 * config["mamba_n_groups"] * config["mamba_d_state"]
        conv = conv_dim * (config["mamba_d_conv"] - 1)
        ssm = config["mamba_n_heads"] * config["mamba_d_head"] * config["mamba_d_state"]
    else:
        key_dim = config["linear_num_key_heads"] * config["linear_key_head_dim"]
        value_dim = config["linear_num_value_heads"] * config["linear_value_head_dim"]
        conv = (2 * key_dim + value_dim) * (config["linear_conv_kernel_dim"] - 1)
        ssm = value_dim * config["linear_key_head_dim"]
    return num_state * (conv + ssm) * 4


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def checkpoint(family: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = BUILDERS[family](tmp_path_factory.mktemp(family) / "model")
    write_tokenizer(path, vocab_size=VOCAB_SIZE)
    return path


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> list[list[int]]:
    reference = load_reference(checkpoint)
    return [reference_generate(reference, p, MAX_TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def served(checkpoint: Path) -> Iterator[Stack]:
    """Supervised (a killed child is restarted, as `splitserve up` does); --kv-cache-memory-bytes
    covers the state slots (reserved first) and NUM_BLOCKS blocks and a byte short of one more,
    so the block count checked below is the sizing's."""
    config = json.loads((checkpoint / "config.json").read_text())
    slots = (MAX_NUM_SEQS + 1) * state_bytes(config)  # the null slot too
    kv_bytes = str(NUM_BLOCKS * block_bytes(config) + slots + block_bytes(config) - 1)
    flags = [
        *("--max-model-len", "64", "--kv-cache-memory-bytes", kv_bytes),
        *("--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", "24"),
        *("--dtype", "float32", "--step-timeout-floor", "2"),
    ]
    stack = Stack(checkpoint, core_flags=flags, supervise=True).start()
    yield stack
    stack.stop()


def sdk_for(stack: Stack) -> tuple[openai.OpenAI, str]:
    sdk = openai.OpenAI(base_url=f"{stack.http}/v1", api_key="unused", max_retries=0)
    return sdk, sdk.models.list().data[0].id


def decode(checkpoint: Path, outputs: list[list[int]]) -> list[str]:
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    return [tokenizer.decode(ids, skip_special_tokens=False) for ids in outputs]


EXTRA = {"ignore_eos": True, "skip_special_tokens": False}


def test_the_sdk_gets_transformers_greedy_tokens_through_preemptions(
    served: Stack, checkpoint: Path, expected: list[list[int]]
) -> None:
    sdk, model = sdk_for(served)

    def complete(prompt: list[int]) -> str:
        reply = sdk.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, extra_body=EXTRA
        )
        return reply.choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(complete, PROMPTS))
    assert texts == decode(checkpoint, expected)
    _, metrics = get(served.http, "/metrics")
    families = list(text_string_to_metric_families(metrics))
    info = next(f for f in families if f.name == "vllm:cache_config_info").samples[0].labels
    assert int(info["num_gpu_blocks"]) == NUM_BLOCKS, "the state slots came out of the budget"
    assert info["enable_prefix_caching"] == "False"
    values = {s.name: s.value for f in families for s in f.samples}
    assert values["vllm:num_preemptions_total"] > 0, values
    stats = served.scheduler_stats()
    assert stats.num_total_state_slots == MAX_NUM_SEQS
    assert (stats.num_used_state_slots, stats.kv_cache_usage) == (0, 0.0), "every slot freed"


class SdkStreams:
    """One streamed completion per prompt, each on its own thread, collecting its text."""

    def __init__(self, stack: Stack) -> None:
        self.sdk, self.model = sdk_for(stack)
        self.chunks: list[list[str]] = [[] for _ in PROMPTS]
        self.errors: dict[int, BaseException] = {}
        self.threads = [threading.Thread(target=self._read, args=(i,)) for i in range(len(PROMPTS))]
        for thread in self.threads:
            thread.start()

    def _read(self, i: int) -> None:
        try:
            stream = self.sdk.completions.create(
                model=self.model,
                prompt=PROMPTS[i],
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                stream=True,
                extra_body=EXTRA,
            )
            for chunk in stream:
                if chunk.choices:
                    self.chunks[i].append(chunk.choices[0].text)
        except BaseException as err:  # noqa: BLE001 (reported by the test)
            self.errors[i] = err

    def join(self) -> list[str]:
        for thread in self.threads:
            thread.join(300)
        return ["".join(c) for c in self.chunks]


def test_a_worker_killed_mid_stream_is_restarted_and_every_stream_resumes(
    served: Stack, checkpoint: Path, expected: list[list[int]]
) -> None:
    streams = SdkStreams(served)
    deadline = time.monotonic() + 120
    while max(len(c) for c in streams.chunks) < 3:
        assert time.monotonic() < deadline and not streams.errors, streams.errors
        time.sleep(0.02)
    assert min(len(c) for c in streams.chunks) < MAX_TOKENS, "the load ended too soon"
    served.child("worker[0]").process.send_signal(signal.SIGKILL)
    texts = streams.join()
    assert not streams.errors, streams.errors
    assert texts == decode(checkpoint, expected), "a stream differs after the restart"

"""/v1/embeddings end to end with the openai SDK, against embedders saved by sentence-transformers
itself: the vectors equal sentence-transformers' (cosine >= 0.9999) whatever the chunking,
float and base64 agree, Matryoshka `dimensions` truncate and re-normalize, bad input gets a
400 naming its field, and each kind of engine refuses the other's routes clearly."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import openai
import pytest
import torch
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc

from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc
from tests.e2e.stack import Stack
from tests.fixtures.embedder import load_embedder, make_embedder

pytestmark = pytest.mark.slow
MATRYOSHKA = [16, 32]
TEXTS = [
    "hello world",
    "the river runs through the quiet mountain garden at night " * 4,  # > one 16-token chunk
    "a small model serves a stream of tokens.",
]


@pytest.fixture(scope="module")
def embedder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("embedders")
    extra = {"matryoshka_dimensions": MATRYOSHKA}
    return make_embedder(root / "qwen3-mean", "qwen3", "mean", seed=5, config_extra=extra)


@pytest.fixture(scope="module")
def embed_stack(embedder_dir: Path) -> Iterator[Stack]:
    """A bare Qwen3Model checkpoint: --runner auto serves it for pooling; prompts over 16
    tokens are chunked."""
    flags = ["--max-num-batched-tokens", "16", "--max-model-len", "128"]
    running = Stack(embedder_dir, core_flags=flags).start()
    yield running
    running.stop()


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http}/v1", api_key="unused", max_retries=0, timeout=120)


def model_name(stack: Stack) -> str:
    return client(stack).models.list().data[0].id


def cosines(ours: np.ndarray, ref: np.ndarray) -> np.ndarray:
    return (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)


def test_embeddings_equal_sentence_transformers(embed_stack: Stack, embedder_dir: Path) -> None:
    reference = load_embedder(embedder_dir)
    reply = client(embed_stack).embeddings.create(model=model_name(embed_stack), input=TEXTS)
    ours = np.array([d.embedding for d in reply.data])
    ref = reference.encode(TEXTS)
    assert [d.index for d in reply.data] == [0, 1, 2]
    assert cosines(ours, ref).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, rtol=1e-5)  # Normalize
    num_tokens = sum(len(reference.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == num_tokens


def test_base64_token_ids_and_dimensions(embed_stack: Stack, embedder_dir: Path) -> None:
    sdk, model = client(embed_stack), model_name(embed_stack)
    as_float = sdk.embeddings.create(model=model, input=TEXTS[1], encoding_format="float")
    default = sdk.embeddings.create(model=model, input=TEXTS[1])  # the SDK asks for base64
    assert default.data[0].embedding == as_float.data[0].embedding
    as_b64 = sdk.embeddings.create(model=model, input=TEXTS[1], encoding_format="base64")
    decoded = np.frombuffer(base64.b64decode(as_b64.data[0].embedding), "<f4")  # type: ignore[arg-type]
    assert decoded.tolist() == as_float.data[0].embedding
    ids = load_embedder(embedder_dir).tokenizer(TEXTS[1])["input_ids"]
    by_ids = sdk.embeddings.create(model=model, input=ids)
    np.testing.assert_allclose(by_ids.data[0].embedding, as_float.data[0].embedding, atol=1e-6)
    short = sdk.embeddings.create(model=model, input=TEXTS[1], dimensions=16).data[0].embedding
    full = torch.tensor(as_float.data[0].embedding)
    want = torch.nn.functional.normalize(full[:16], dim=0).numpy()
    np.testing.assert_allclose(short, want, atol=1e-6)


def test_pooling_gives_the_embeddings(embed_stack: Stack) -> None:
    """/pooling on an embedder: each input's embedding as /v1/embeddings gives it (float and
    base64, `dimensions`); what the model cannot give gets a 400 naming the field."""
    sdk, model = client(embed_stack), model_name(embed_stack)
    want = [d.embedding for d in sdk.embeddings.create(model=model, input=TEXTS[:2],
                                                       encoding_format="float").data]  # fmt: skip
    reply = httpx.post(f"{embed_stack.http}/pooling", json={"input": TEXTS[:2]}, timeout=60)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["id"].startswith("pool-") and {d["object"] for d in body["data"]} == {"pooling"}
    np.testing.assert_allclose([d["data"] for d in body["data"]], want, atol=1e-6)
    short = {"input": TEXTS[0], "task": "embed", "dimensions": 16, "encoding_format": "base64"}
    encoded = httpx.post(f"{embed_stack.http}/pooling", json=short, timeout=60).json()
    got = np.frombuffer(base64.b64decode(encoded["data"][0]["data"]), "<f4")
    wanted = torch.nn.functional.normalize(torch.tensor(want[0])[:16], dim=0).numpy()
    np.testing.assert_allclose(got, wanted, atol=1e-6)
    for path, extra, field in (
        ("/pooling", {"normalize": False}, "normalize"),
        ("/pooling", {"embed_dtype": "float16"}, "embed_dtype"),
        ("/pooling", {"task": "classify"}, "model"),
        ("/classify", {}, "model"),  # not a classifier
    ):
        refused = httpx.post(f"{embed_stack.http}{path}", json={"input": "x", **extra}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input": []}, "input"),
        ({"input": True}, "input"),
        ({"input": [[1, 2], "x"]}, "input"),
        ({"input": [999999]}, "input"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "dimensions": 20}, "dimensions"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "river " * 400}, "input"),
        ({"input": ["x"] * 10_000}, "input"),
        ({"input": "x", "model": "other"}, None),  # 404, as every route
        ({}, "input"),
    ],
)
def test_bad_input_gets_a_400_naming_the_field(
    embed_stack: Stack, body: dict[str, Any], field: str | None
) -> None:
    body = {"model": model_name(embed_stack), **body}
    reply = httpx.post(f"{embed_stack.http}/v1/embeddings", json=body, timeout=60)
    assert reply.status_code == (400 if field else 404), reply.text
    error = reply.json()["error"]
    assert error["param"] == field and error["message"]


def test_generation_routes_on_a_pooling_engine_are_refused(embed_stack: Stack) -> None:
    sdk, model = client(embed_stack), model_name(embed_stack)
    with pytest.raises(openai.BadRequestError, match="does not support the Completions API"):
        sdk.completions.create(model=model, prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="Chat Completions API"):
        sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    assert sdk.embeddings.create(model=model, input="still serving").data  # unharmed


def test_embeddings_on_a_generation_engine_are_refused(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError, match="does not support the Embeddings API"):
        client(stack).embeddings.create(model=model_name(stack), input="hi")


def test_convert_embed_serves_a_causal_lm_with_last_token_pooling(embedder_dir: Path) -> None:
    """A full Qwen3ForCausalLM checkpoint (no sentence-transformers files) with --convert embed,
    at TP=2: vLLM's decoder default, the last token's hidden state, normalized."""
    import transformers

    base = embedder_dir.with_name(embedder_dir.name + "-base")
    running = Stack(base, tp=2, core_flags=["--convert", "embed"]).start()  # and over TP=2
    try:
        reply = client(running).embeddings.create(model=model_name(running), input=TEXTS[2])
    finally:
        running.stop()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(base))
    hf = transformers.AutoModel.from_pretrained(str(base)).eval()
    with torch.no_grad():
        ids = torch.tensor([tokenizer(TEXTS[2])["input_ids"]])
        last = hf(input_ids=ids).last_hidden_state[0, -1]
    want = torch.nn.functional.normalize(last, dim=0).numpy()
    assert cosines(np.array([reply.data[0].embedding]), want[None]).min() >= 0.9999


def test_grpc_embed_and_the_gateway_contract_embed(embed_stack: Stack) -> None:
    """The public API's Embed and the VllmEngine contract's Embed give the HTTP route's vectors;
    Generate on the pooling engine is refused with INVALID_ARGUMENT."""
    http = client(embed_stack).embeddings.create(model=model_name(embed_stack), input=TEXTS[:2])
    with grpc.insecure_channel(embed_stack.frontend) as channel:
        public = gen_grpc.GenerationServiceStub(channel)
        reply = public.Embed(
            gen_pb2.EmbedRequest(
                inputs=[gen_pb2.EmbedInput(text=t) for t in TEXTS[:2]], dimensions=32
            ),
            timeout=60,
        )
        ids = public.Tokenize(gen_pb2.TokenizeRequest(prompt=TEXTS[0]), timeout=30).token_ids
        gateway = pb_grpc.VllmEngineStub(channel)
        one = gateway.Embed(
            pb.EmbedRequest(request_id="e1", tokenized=pb.TokenizedInput(input_ids=ids)),
            timeout=60,
        )
        with pytest.raises(grpc.RpcError) as refused:
            next(iter(public.Generate(gen_pb2.GenerateRequest(prompt="hi"), timeout=30)))
        with pytest.raises(grpc.RpcError) as empty:
            public.Embed(gen_pb2.EmbedRequest(), timeout=30)
        info = gateway.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    full = [torch.tensor(d.embedding) for d in http.data]
    for got, want in zip(reply.embeddings, full, strict=True):
        short = torch.nn.functional.normalize(want[:32], dim=0).numpy()
        np.testing.assert_allclose(got.values, short, atol=1e-6)
    assert reply.embeddings[0].prompt_tokens == len(ids) == one.prompt_tokens
    assert one.embedding_dim == len(full[0])
    np.testing.assert_allclose(one.embedding, full[0].numpy(), atol=1e-6)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "pooling model" in (refused.value.details() or "")
    assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not info.is_generation


def test_an_int8_embedder_with_lora_slots_stays_close(embedder_dir: Path) -> None:
    """Where pooling meets main's linear methods: every decoder linear int8-quantized at load
    and wrapped with LoRA slots, the pooled vectors still follow sentence-transformers'."""
    flags = ["--max-model-len", "128", "--quantization", "int8"]
    flags += ["--enable-lora", "--max-loras", "1", "--max-lora-rank", "8"]
    stack = Stack(embedder_dir, core_flags=flags).start()
    try:
        sdk = client(stack)
        reply = sdk.embeddings.create(model=model_name(stack), input=TEXTS, encoding_format="float")
    finally:
        stack.stop()
    ours = np.array([d.embedding for d in reply.data])
    assert cosines(ours, load_embedder(embedder_dir).encode(TEXTS)).min() >= 0.999

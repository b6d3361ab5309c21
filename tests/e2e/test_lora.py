"""LoRA adapters on a real stack: the openai SDK names an adapter as its model (greedy output
equals transformers + peft), /v1/models lists adapters with their parent, adapters load and
unload at runtime under load (no request in flight fails; the unloaded name is refused
clearly afterwards), the admin gRPC service does the same behind the API key, and
vllm:lora_requests_info shows the running adapters."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from splitserve.children import stop_children
from splitserve_contracts.frontend.v1 import admin_service_pb2 as admin_pb2
from splitserve_contracts.frontend.v1 import admin_service_pb2_grpc as admin_grpc
from tests.e2e.client import generate, text_request
from tests.e2e.stack import Stack
from tests.e2e.test_generate import PROMPT, hf_greedy
from tests.fixtures.lora_adapters import load_peft_reference, make_adapter

pytestmark = pytest.mark.slow
MODEL = "tiny-llama-v1"
GREEDY: dict[str, Any] = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("e2e-lora")
    return {
        "first": make_adapter(tiny_model_dir, root / "first", seed=1),
        "second": make_adapter(tiny_model_dir, root / "second", seed=2, rank=4),
    }


@pytest.fixture(scope="module")
def lora_stack(tiny_model_dir: Path, adapters: dict[str, Path]) -> Iterator[Stack]:
    core_flags = ["--enable-lora", "--max-loras", "2", "--lora-modules"]
    core_flags.append(json.dumps({"name": "first", "path": str(adapters["first"])}))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        stack = Stack(tiny_model_dir, core_flags=core_flags).start()
    yield stack
    stack.stop()


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http}/v1", api_key="unused", max_retries=0, timeout=120)


def post(stack: Stack, route: str, body: dict[str, Any]) -> tuple[int, str]:
    request = urllib.request.Request(
        f"{stack.http}{route}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_the_openai_sdk_names_an_adapter_as_its_model(
    lora_stack: Stack, adapters: dict[str, Path], tiny_model_dir: Path, tokenizer: Any
) -> None:
    sdk = client(lora_stack)
    cards = {m.id: m for m in sdk.models.list().data}
    assert set(cards) == {MODEL, "first"}
    assert cards["first"].parent == MODEL and cards["first"].root == str(adapters["first"])
    reference = load_peft_reference(tiny_model_dir, adapters["first"])
    expected = tokenizer.decode(hf_greedy(reference, tokenizer.encode(PROMPT), 16))
    reply = sdk.completions.create(model="first", prompt=PROMPT, max_tokens=16, **GREEDY)
    assert (reply.model, reply.choices[0].text) == ("first", expected)
    base = sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, **GREEDY)
    assert base.choices[0].text != expected, "the base model's rows get no adapter"
    chat = sdk.chat.completions.create(
        model="first", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.model == "first"
    over_grpc = generate(
        lora_stack.frontend,
        text_request(PROMPT, temperature=0.0, max_tokens=16, ignore_eos=True),
    )
    assert over_grpc[0].text == base.choices[0].text
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        sdk.completions.create(model="no-such-adapter", prompt=PROMPT, max_tokens=2)


def test_responses_name_an_adapter_as_their_model(lora_stack: Stack) -> None:
    """/v1/responses runs the adapter its `model` names: the chat route's greedy answer with
    that adapter, not the base model's; an unknown name gets the same 404."""
    sdk = client(lora_stack)
    chat = sdk.chat.completions.create(
        model="first", messages=[{"role": "user", "content": PROMPT}], max_tokens=12, **GREEDY
    )
    want = chat.choices[0].message.content
    adapted = sdk.responses.create(model="first", input=PROMPT, max_output_tokens=12, **GREEDY)
    assert (adapted.model, adapted.output_text) == ("first", want)
    base = sdk.responses.create(model=MODEL, input=PROMPT, max_output_tokens=12, **GREEDY)
    assert base.model == MODEL and base.output_text != want
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        sdk.responses.create(model="no-such-adapter", input=PROMPT, max_output_tokens=2)


def _stream(stack: Stack, model: str, results: list[Any]) -> None:
    try:
        chunks = client(stack).completions.create(
            model=model, prompt=PROMPT, max_tokens=48, stream=True, **GREEDY
        )
        results.append([c.choices[0].finish_reason for c in chunks if c.choices][-1])
    except Exception as err:  # noqa: BLE001 (the test reports it)
        results.append(err)


def _lora_info(stack: Stack) -> str:
    with urllib.request.urlopen(f"{stack.http}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return next(line for line in text.splitlines() if line.startswith("vllm:lora_requests_info"))


def test_runtime_load_and_unload_under_load(lora_stack: Stack, adapters: dict[str, Path]) -> None:
    """Unloading an adapter in use: its requests in flight finish with it (vLLM's rule), new
    ones naming it get 404; loading one under load serves it at once."""
    results: list[Any] = []
    threads = [
        threading.Thread(target=_stream, args=(lora_stack, model, results))
        for model in ["first", MODEL, "first", MODEL, "first"]
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while 'running_lora_adapters="first"' not in _lora_info(lora_stack):
        assert time.monotonic() < deadline, _lora_info(lora_stack)
        time.sleep(0.05)
    status, body = post(
        lora_stack,
        "/v1/load_lora_adapter",
        {"lora_name": "second", "lora_path": str(adapters["second"])},
    )
    assert (status, body) == (200, "Success: LoRA adapter 'second' added successfully.")
    second = client(lora_stack).completions.create(model="second", prompt=PROMPT, max_tokens=4)
    assert second.model == "second" and second.usage is not None
    status, body = post(lora_stack, "/v1/unload_lora_adapter", {"lora_name": "first"})
    assert (status, body) == (200, "Success: LoRA adapter 'first' removed successfully.")
    with pytest.raises(openai.NotFoundError, match="`first` does not exist"):
        client(lora_stack).completions.create(model="first", prompt=PROMPT, max_tokens=2)
    for thread in threads:
        thread.join(timeout=120)
    assert results == ["length"] * 5
    status, body = post(
        lora_stack,
        "/v1/load_lora_adapter",
        {"lora_name": "first", "lora_path": str(adapters["first"])},
    )
    assert status == 200
    status, body = post(lora_stack, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no"})
    assert status == 404 and "Loading lora x failed: No adapter found for /no" in body
    status, body = post(
        lora_stack,
        "/v1/load_lora_adapter",
        {"lora_name": "first", "lora_path": str(adapters["second"])},
    )
    assert status == 400 and "has already been loaded" in body


def test_the_admin_service_and_its_switches(
    lora_stack: Stack, adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """AdminService lists and loads like the HTTP routes, behind the API key; without
    VLLM_ALLOW_RUNTIME_LORA_UPDATING a frontend refuses loads (gRPC FAILED_PRECONDITION,
    HTTP 404 as vLLM, whose routes are then absent), saying what to set."""
    with grpc.insecure_channel(lora_stack.frontend) as channel:
        admin = admin_grpc.AdminServiceStub(channel)
        listed = admin.ListModels(admin_pb2.ListModelsRequest(), timeout=30)
        assert listed.models[0].id == MODEL
        assert {m.id: m.parent for m in listed.models[1:]} == {"first": MODEL, "second": MODEL}
        with pytest.raises(grpc.RpcError) as refused:
            admin.LoadLoraAdapter(
                admin_pb2.LoadLoraAdapterRequest(lora_name="y", lora_path="relative/path"),
                timeout=30,
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "absolute path" in (refused.value.details() or "")
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    guarded = lora_stack.add_frontend(api_key="admin-key")
    try:
        with grpc.insecure_channel(guarded.address) as channel:
            admin = admin_grpc.AdminServiceStub(channel)
            with pytest.raises(grpc.RpcError) as anonymous:
                admin.ListModels(admin_pb2.ListModelsRequest(), timeout=30)
            assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
            key = (("authorization", "Bearer admin-key"),)
            request = admin_pb2.LoadLoraAdapterRequest(
                lora_name="z", lora_path=str(adapters["second"])
            )
            with pytest.raises(grpc.RpcError) as off:
                admin.LoadLoraAdapter(request, timeout=30, metadata=key)
            assert off.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in (off.value.details() or "")
    finally:
        stop_children([guarded])

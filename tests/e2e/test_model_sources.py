"""Model sources end to end, through real processes: a .gguf file (weights on the worker, tokenizer
on the frontend, both from the file), a Hub id with --revision from a stand-in Hub (every process
resolves it alike) whose generation_config.json sampling defaults the frontend applies on gRPC
and on the OpenAI HTTP API, a weights-only folder served with --tokenizer, and refusals that
reach the operator as one line from `splitserve up`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc
from splitserve_runtime.gguf_checkpoint import load_gguf_tokenizer
from splitserve_runtime.tiny_model import write_tokenizer
from tests.e2e.client import generate, text_request
from tests.e2e.stack import UP_ANY_METRICS_PORTS, Stack
from tests.e2e.test_openai_http import post
from tests.fixtures.checkpoints import VOCAB_SIZE, CheckpointCache
from tests.fixtures.gguf_files import write_gguf
from tests.fixtures.hub_server import HubStandIn
from tests.fixtures.parity import reference_generate

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
REPO = "acme/tiny-llama"
LENGTH = types_pb2.FINISH_REASON_LENGTH


def model_info(addr: str) -> gen_pb2.GetModelInfoResponse:
    with grpc.insecure_channel(addr) as channel:
        stub = gen_grpc.GenerationServiceStub(channel)
        return stub.GetModelInfo(gen_pb2.GetModelInfoRequest(), timeout=30)


def tokenize(addr: str, text: str) -> list[int]:
    with grpc.insecure_channel(addr) as channel:
        stub = gen_grpc.GenerationServiceStub(channel)
        return list(stub.Tokenize(gen_pb2.TokenizeRequest(prompt=text), timeout=30).token_ids)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("e2e-gguf")
    write_tokenizer(root / "tokenizer", vocab_size=VOCAB_SIZE)
    source = CheckpointCache(root / "checkpoints").get("llama")
    return write_gguf(root / "tiny.Q4_1.gguf", source, root / "tokenizer", "Q4_1")


def test_a_gguf_file_serves_end_to_end(gguf_file: Path) -> None:
    from transformers import AutoModelForCausalLM

    stack = Stack(gguf_file).start()
    try:
        info = model_info(stack.frontend)
        assert info.served_model_name == "tiny.Q4_1" and info.has_chat_template
        text = "the worker streams a token"
        assert tokenize(stack.frontend, text) == load_gguf_tokenizer(gguf_file).encode(text)
        prompt = [5, 9, 33, 7, 100, 200, 3]
        params = types_pb2.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        request = gen_pb2.GenerateRequest(
            prompt_token_ids=gen_pb2.TokenIds(ids=prompt), sampling_params=params
        )
        ours = generate(stack.frontend, request)[0].token_ids
    finally:
        stack.stop()
    reference = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()
    assert ours == reference_generate(reference, prompt, 8)


@pytest.fixture(scope="module")
def hub(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubStandIn]:
    """main: the tiny model as is; v2: its generation config recommends max_new_tokens 5."""
    v2 = tmp_path_factory.mktemp("hub-v2") / "tiny"
    shutil.copytree(tiny_model_dir, v2)
    generation = json.loads((v2 / "generation_config.json").read_text())
    (v2 / "generation_config.json").write_text(json.dumps({**generation, "max_new_tokens": 5}))
    server = HubStandIn({REPO: {"main": tiny_model_dir, "v2": v2}}).start()
    yield server
    server.stop()


def test_a_hub_id_at_a_revision_serves_with_its_generation_defaults(
    hub: HubStandIn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setenv("HF_TOKEN", "hf_e2e")
    stack = Stack(REPO, revision="v2").start()
    try:
        assert model_info(stack.frontend).served_model_name == REPO
        unset = generate(stack.frontend, gen_pb2.GenerateRequest(prompt="river stone"))[0]
        assert (len(unset.token_ids), unset.finish_reason) == (5, LENGTH)
        params = types_pb2.SamplingParams(max_tokens=2, ignore_eos=True)
        chosen = generate(
            stack.frontend, gen_pb2.GenerateRequest(prompt="hi", sampling_params=params)
        )
        assert len(chosen[0].token_ids) == 2
    finally:
        stack.stop()
    asked = [r for r in hub.requests if r.path == f"/api/models/{REPO}/revision/v2"]
    assert len(asked) >= 2  # the worker rank and the frontend each resolved the revision
    model_requests = [r for r in hub.requests if r.path.startswith(("/api/models/", f"/{REPO}/"))]
    assert {r.authorization for r in model_requests} == {"Bearer hf_e2e"}


def up(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "splitserve"), "up", "--grpc-port", "0", *UP_ANY_METRICS_PORTS, *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **(env or {})},
    )


def last_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 1
    assert "Traceback" not in result.stderr, result.stderr
    return result.stderr.strip().splitlines()[-1]


def test_a_quantized_checkpoint_is_refused_in_one_line(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "bnb"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (folder / "config.json").write_text(json.dumps(config))
    line = last_line(up("--model", str(folder)))
    assert line.startswith("splitserve up: core exited with code 1: worker rank 0")
    assert "quantization method 'bitsandbytes'" in line and "not supported" in line


def test_source_errors_are_one_line_before_anything_starts(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "hf"
    offline = up(
        "--model", "acme/not-cached", env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    )
    line = last_line(offline)
    assert "'acme/not-cached'" in line and str(cache) in line and "HF_HUB_OFFLINE" in line
    assert offline.stderr.strip() == line  # nothing was started
    bare = weights_only(tiny_model_dir, tmp_path / "no-tokenizer")
    no_tokenizer = up("--model", str(bare))
    assert no_tokenizer.stderr.strip() == last_line(no_tokenizer)
    assert "has no tokenizer" in no_tokenizer.stderr and "--tokenizer" in no_tokenizer.stderr


def weights_only(tiny_model_dir: Path, folder: Path) -> Path:
    """The tiny model's config and weights without any tokenizer file."""
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / name, folder / name)
    return folder


def test_a_separate_tokenizer_serves_a_folder_without_one(
    tiny_model_dir: Path, tokenizer: Any, tmp_path: Path
) -> None:
    """--tokenizer: the frontend tokenizes, detokenizes and templates with the named folder's
    tokenizer; the weights come from --model (which alone is refused: see above)."""
    bare = weights_only(tiny_model_dir, tmp_path / "weights-only")
    stack = Stack(bare, tokenizer=str(tiny_model_dir)).start()
    try:
        assert model_info(stack.frontend).has_chat_template
        text = "river stone"
        assert tokenize(stack.frontend, text) == tokenizer.encode(text)
        request = text_request(text, max_tokens=4, ignore_eos=True, temperature=0.0)
        completion = generate(stack.frontend, request)[0]
    finally:
        stack.stop()
    assert len(completion.token_ids) == 4
    assert completion.text == tokenizer.decode(completion.token_ids)


def test_generation_defaults_apply_on_the_openai_http_api(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """generation_config.json's max_new_tokens is the default max_tokens of /v1/completions and
    /v1/chat/completions when the request leaves it unset; a request's own value wins."""
    folder = tmp_path / "short"
    shutil.copytree(tiny_model_dir, folder)
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation, "max_new_tokens": 5}))
    stack = Stack(folder).start()
    try:
        model = model_info(stack.frontend).served_model_name
        unset = {"model": model, "prompt": "river stone", "ignore_eos": True}
        status, body = post(stack.http, "/v1/completions", unset)
        assert status == 200, body
        assert (body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]) == (
            5,
            "length",
        )
        status, body = post(stack.http, "/v1/completions", {**unset, "max_tokens": 2})
        assert (status, body["usage"]["completion_tokens"]) == (200, 2)
        chat = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        status, body = post(stack.http, "/v1/chat/completions", {**chat, "ignore_eos": True})
        assert (status, body["usage"]["completion_tokens"]) == (200, 5), body
    finally:
        stack.stop()

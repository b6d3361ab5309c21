"""`splitserve serve MODEL --pd 1:1` from the command line, end to end: a prefill and a decode
engine (each worker, core and frontend processes) and the real Shepherd Model Gateway (`smg`) in
PD mode; each engine advertises its connector role on GetServerInfo (what smg pairs them by);
chat and completions, streamed and not, go through both engines (the prefill leg on one, the
decode leg on the other); the decode engine's /metrics has the external prefix-cache series.

Whether the decode engine loads the prompt's KV from the prefill engine (external hits) is the
connector's test; here the gateway's sequential flow and the launcher are."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc

from benchmarks.dp_serve import Serve, engine_metric
from tests.fixtures.tiny_serve import tiny_serve

pytestmark = pytest.mark.slow
SUCCESSES = "vllm:request_success_total"


@pytest.fixture(scope="module")
def serve(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    tmp = tmp_path_factory.mktemp("pd")
    with tiny_serve(tiny_model_dir, tmp, "round_robin", pd="1:1") as running:
        said = (tmp / "serve.log").read_text()
        assert said.count("READY") == 1 and " pd=1:1" in said
        yield running


def test_each_engine_advertises_its_role(serve: Serve) -> None:
    roles = []
    for addr in serve.engines:
        with grpc.insecure_channel(addr) as channel:
            info = pb_grpc.VllmEngineStub(channel).GetServerInfo(
                pb.GetServerInfoRequest(), timeout=10
            )
        roles.append((info.kv_connector, info.kv_role, info.kv_engine_id))
    assert roles == [
        ("GrpcConnector", "kv_producer", "prefill-0"),
        ("GrpcConnector", "kv_consumer", "decode-0"),
    ]


def test_chat_and_completions_go_through_both_engines(serve: Serve) -> None:
    client = openai.OpenAI(base_url=f"http://{serve.http}/v1", api_key="-", max_retries=0)
    model = client.models.list().data[0].id
    before = [engine_metric(h, SUCCESSES) for h in serve.engine_http]
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "quiet river"}], max_tokens=6
    )
    assert chat.choices[0].finish_reason == "length" and chat.usage is not None
    assert chat.usage.completion_tokens == 6
    stream = client.completions.create(
        model=model, prompt="a long road home", max_tokens=6, temperature=0, stream=True
    )
    streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    whole = client.completions.create(model=model, prompt="a long road home", max_tokens=6,
                                      temperature=0)  # fmt: skip
    assert streamed == whole.choices[0].text
    after = [engine_metric(h, SUCCESSES) for h in serve.engine_http]
    assert [a - b for a, b in zip(after, before, strict=True)] == [3, 3]  # prefill, decode legs
    with urllib.request.urlopen(f"http://{serve.engine_http[1]}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    for name in ("queries", "hits"):  # what an operator reads on the decode engine
        assert f'vllm:external_prefix_cache_{name}_total{{engine="decode-0"' in text

"""`splitserve serve MODEL --data-parallel-size 2` from the command line, end to end: two engines
(each worker, core and frontend processes) and the real Shepherd Model Gateway (`smg`) in front,
started by the launcher; chat through the gateway; one engine's core killed under load (the other
keeps serving, the killed one's requests resume on its restarted core, nothing is cut short);
the killed engine takes requests through the gateway again; the scale-out benchmark's lost-engine
case, shorter (benchmarks/scaleout_faults.py: a core or a worker rank killed in the middle of a
run, no request hung or cut short, the engine serving again, its KV usage back to 0); SIGTERM
stops everything."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc

from benchmarks.dp_failover import WORDS, kill_engine_process, run_load, wait_serving
from benchmarks.dp_serve import Serve, children_of, engine_metric
from benchmarks.scaleout_faults import run_with_fault
from benchmarks.scaleout_targets import target_of
from benchmarks.scaleout_workload import Shape, no_sharing
from tests.fixtures.tiny_serve import tiny_serve

pytestmark = pytest.mark.slow
SUCCESSES = "vllm:request_success_total"


@pytest.fixture(scope="module")
def serve(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    with tiny_serve(tiny_model_dir, tmp_path_factory.mktemp("dp"), "cache_aware") as running:
        yield running


@pytest.fixture(scope="module")
def client(serve: Serve) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{serve.http}/v1", api_key="-", max_retries=0)


def test_the_gateway_serves_chat_across_both_engines(serve: Serve, client: openai.OpenAI) -> None:
    """READY names the gateway and two engines, each serving the engine contract with its own
    data-parallel rank and KV-cache events (what cache_aware routes by); chat goes through."""
    assert len(serve.engines) == 2 and len(set(serve.engines)) == 2
    for rank, addr in enumerate(serve.engines):
        with grpc.insecure_channel(addr) as channel:
            stub = pb_grpc.VllmEngineStub(channel)
            assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy
            info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
            assert info.server_type == "vllm-grpc"
        argv = next(a for _, a in children_of(serve.server.process.pid)
                    if "frontend_svc" in a and a[a.index("--port") + 1] == addr.rsplit(":")[1])  # fmt: skip
        assert argv[argv.index("--data-parallel-rank") + 1] == str(rank)
        assert '"enable_kv_cache_events": true' in argv[argv.index("--kv-events-config") + 1]
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "quiet river"}], max_tokens=8
    )
    assert reply.choices[0].finish_reason == "length" and reply.usage is not None
    assert reply.usage.completion_tokens == 8


def test_a_killed_core_loses_no_request_and_its_engine_serves_again(
    serve: Serve, client: openai.OpenAI
) -> None:
    model = client.models.list().data[0].id
    wait_serving(serve, 1, client, model)
    served_before = [engine_metric(h, SUCCESSES) for h in serve.engine_http]
    running: list[float] = []
    counts = run_load(
        f"http://{serve.http}", model, num_requests=24, concurrency=6, max_tokens=48,
        fault=lambda: kill_engine_process(serve, 1, "core", running),
    )  # fmt: skip
    assert running, "the fault ran"
    assert counts["complete"] == 24, counts  # no error, nothing cut short
    assert engine_metric(serve.engine_http[0], SUCCESSES) > served_before[0]
    log = serve.server.log_path.read_text(errors="replace")
    assert "engine[1] core exited with code -9; restarting it" in log
    wait_serving(serve, 1, client, model, timeout=120)  # the gateway routes to it again
    assert "engine[1] core is ready again" in serve.server.log_path.read_text(errors="replace")


@pytest.mark.parametrize("fault", ["core", "worker"])
def test_an_engine_lost_under_load_hangs_and_cuts_short_no_request(
    serve: Serve, client: openai.OpenAI, fault: str
) -> None:
    model = client.models.list().data[0].id
    wait_serving(serve, 1, client, model)
    shape = Shape("lost-engine", 4, 1, 3, 24, 8, 24)  # prompts of 32-56 words, 24 tokens each
    workload = no_sharing(WORDS, 6.0, 3, shape, 18)
    results, _, stats = run_with_fault(target_of(serve), model, workload, 1, fault, 1.0)
    assert len(results) == 18
    assert stats.outcomes["hung"] == stats.outcomes["truncated"] == 0, stats
    assert stats.outcomes["complete"] + stats.outcomes["error"] == 18, stats
    assert stats.serving_again_s < 120, stats  # probes to its own server are answered again
    assert stats.kv_usage_after == 0.0, stats  # the restarted engine freed every block
    log = serve.server.log_path.read_text(errors="replace")
    assert f"engine[1] {fault}" in log and "exited with code -9" in log
    wait_serving(serve, 1, client, model, timeout=120)  # the gateway routes to it again


def test_sigterm_stops_the_gateway_and_every_engine(serve: Serve) -> None:
    launcher = serve.server.process
    children = [pid for pid, _ in children_of(launcher.pid)]
    assert len(children) == 7  # 2 x (worker, core, frontend) + the gateway
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=120) == 0
    for pid in children:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)

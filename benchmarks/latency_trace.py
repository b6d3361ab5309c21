"""`python -m benchmarks.latency_trace [-- CORE FLAGS]`: where W3's slowest first tokens go, on
a real stack.

Starts a worker, core and frontend on the benchmark checkpoint with `make bench-peer`'s
settings (bfloat16, --max-model-len 1024, --max-num-seqs 64, plus the core flags given after
`--`), the frontend exporting every request's `llm_request` span (vLLM's attributes) to an
OTLP/gRPC sink in this process, and sends bench-peer's W3 (64 requests, Poisson at 2 req/s)
through the public gRPC API. For the slowest first tokens it prints, in ms:

    client_ttft   request sent -> first token received (what bench-peer's TTFT p99 is made of)
    ttft          the frontend's: arrival -> first output (vllm:time_to_first_token_seconds)
    queue         the core's waiting queue: queued -> first scheduled
                  (gen_ai.latency.time_in_queue, vllm:request_queue_time_seconds); the core
                  queues a request between steps, so the wait for the step running when it
                  arrived is not here but in `hops`
    prefill       first scheduled -> first token, in the core (time_in_model_prefill,
                  vllm:request_prefill_time_seconds): its chunks, and the steps in flight
                  before its first one under async scheduling
    hops          ttft - queue - prefill: frontend -> core (and the core's inbox, until the step
                  in flight ends), the first token back to the frontend
    to_client     client_ttft - ttft: the client's gRPC legs and the frontend's first message

The simulator (`python -m benchmarks.latency_policy --breakdown N`) splits `queue` and
`prefill` further, step by step, for the same W3. Tracing costs a little (docs/benchmarks.md,
tracing overhead): compare runs of this script with each other, and TTFT against vLLM with
`make bench-peer`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from collections.abc import Sequence
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from benchmarks.bench_model import VOCAB_SIZE, ensure_bench_model
from benchmarks.latency_breakdown import slowest
from benchmarks.peer_client import GrpcTransport, run_workload
from benchmarks.peer_workloads import Workload, build_suite
from benchmarks.serve_compare import stack_options
from splitserve.children import start_children, stop_children, wait_ready
from splitserve_client.bench_serve import RequestResult

PEER_FLAGS = ["--dtype", "bfloat16", "--max-model-len", "1024", "--max-num-seqs", "64"]
LATENCIES = {
    "ttft": "gen_ai.latency.time_to_first_token",
    "queue": "gen_ai.latency.time_in_queue",
    "prefill": "gen_ai.latency.time_in_model_prefill",
}


class RequestSpans(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver on loopback keeping each `llm_request` span's latencies
    (seconds) with its prompt and completion token counts."""

    def __init__(self) -> None:
        self.requests: list[dict[str, float]] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.endpoint = f"http://127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"

    def Export(  # noqa: N802 (gRPC method name)
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    if span.name == "llm_request":
                        attributes = {kv.key: kv.value for kv in span.attributes}
                        row = {
                            name: attributes[key].double_value
                            for name, key in LATENCIES.items()
                            if key in attributes
                        }
                        for name in ("prompt_tokens", "completion_tokens"):
                            row[name] = attributes[f"gen_ai.usage.{name}"].int_value
                        with self._lock:
                            self.requests.append(row)
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, num: int, timeout: float = 30.0) -> list[dict[str, float]]:
        """The spans once `num` arrived (the exporter batches) or `timeout` passed."""
        deadline = time.monotonic() + timeout
        while len(self.requests) < num and time.monotonic() < deadline:
            time.sleep(0.2)
        with self._lock:
            return list(self.requests)


def breakdown(
    workload: Workload, results: list[RequestResult], spans: list[dict[str, float]], num: int
) -> list[dict[str, float]]:
    """The `num` slowest client TTFTs, each with its span's parts (matched by prompt and
    completion lengths; parts are left out where two requests share both)."""
    by_shape: dict[tuple[int, int], list[dict[str, float]]] = {}
    for span in spans:
        by_shape.setdefault(
            (int(span["prompt_tokens"]), int(span["completion_tokens"])), []
        ).append(span)
    ttfts = [r.ttft if r.token_times else float("inf") for r in results]
    rows = []
    for i in slowest(ttfts, num):
        spec = workload.requests[i]
        row = {"prompt_tokens": len(spec.prompt_token_ids), "client_ttft_ms": 1e3 * ttfts[i]}
        matches = by_shape.get((len(spec.prompt_token_ids), spec.max_tokens), [])
        if len(matches) == 1 and LATENCIES.keys() <= matches[0].keys():
            span = matches[0]
            parts = {name: 1e3 * span[name] for name in LATENCIES}
            parts["hops"] = parts["ttft"] - parts["queue"] - parts["prefill"]
            parts["to_client"] = row["client_ttft_ms"] - parts["ttft"]
            row |= {f"{name}_ms": value for name, value in parts.items()}
        rows.append({k: round(v, 1) for k, v in row.items()})
    return rows


async def measure(args: argparse.Namespace) -> list[dict[str, float]]:
    suite = build_suite(VOCAB_SIZE, args.seed)
    workload = Workload(suite.w3.name, suite.w3.requests[: args.num_requests])
    sink = RequestSpans()
    sink.server.start()
    frontend_flags = ["--otlp-traces-endpoint", sink.endpoint]
    model = args.model or str(ensure_bench_model(None))
    children = start_children(stack_options(model, [*PEER_FLAGS, *args.core_flags], frontend_flags))
    try:
        await asyncio.to_thread(wait_ready, children, 600.0)
        transport = GrpcTransport(children[-1].address)
        try:
            await run_workload(transport, suite.warmup)  # first steps warm up; not reported
            await asyncio.to_thread(sink.wait_for, len(suite.warmup.requests))
            sink.requests.clear()
            results, _ = await run_workload(transport, workload)
        finally:
            await transport.aclose()
        spans = await asyncio.to_thread(sink.wait_for, len(workload.requests))
        return breakdown(workload, results, spans, args.slowest)
    finally:
        await asyncio.to_thread(stop_children, children)
        sink.server.stop(None)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="", help="default: the benchmark checkpoint")
    parser.add_argument("--seed", type=int, default=0, help="bench-peer's workload seed")
    parser.add_argument("--num-requests", type=int, default=64, help="the first N of W3")
    parser.add_argument("--slowest", type=int, default=5, help="requests to print")
    parser.add_argument("core_flags", nargs="*", help="more core flags, after --")
    args = parser.parse_args(argv)
    for row in asyncio.run(measure(args)):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

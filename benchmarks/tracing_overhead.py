"""`python -m benchmarks.tracing_overhead [--rounds N]`: what tracing costs (make bench-tracing).

Two stacks on the benchmark checkpoint, one plain and one with --otlp-traces-endpoint on the
frontend, the engine core and the worker (every request traced: spans from all three services),
exporting to an OTLP/gRPC sink in this process that counts and drops them. W1 (32 x 256 in, 64
out) alternates between the stacks for N rounds (benchmarks/flag_ab.py), so a busy machine's
drift hits both alike. Prints per-round output tok/s and the CPU seconds the stack's processes
used (a steadier measure than throughput on a shared machine), the median of each side and the
traced side's throughput relative to the plain one (the target: at most 3 % less). Run it with
`OMP_NUM_THREADS=1` on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from collections.abc import Sequence
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from benchmarks.flag_ab import Row, run


class SpanSink(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver on loopback that counts spans and keeps none."""

    def __init__(self) -> None:
        self.num_spans = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    def Export(  # noqa: N802 (gRPC method name)
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.num_spans += sum(
            len(scope.spans) for rs in request.resource_spans for scope in rs.scope_spans
        )
        return trace_service_pb2.ExportTraceServiceResponse()


def summary(rows: list[Row], num_spans: int) -> dict[str, float | int]:
    plain = [float(r["tok_s"]) for r in rows if r["side"] == "plain"]
    traced = [float(r["tok_s"]) for r in rows if r["side"] == "flags"]
    ratios = [t / p for p, t in zip(plain, traced, strict=True)]
    cpu_plain = [float(r["cpu_s"]) for r in rows if r["side"] == "plain"]
    cpu_traced = [float(r["cpu_s"]) for r in rows if r["side"] == "flags"]
    return {
        "plain_median_tok_s": round(statistics.median(plain), 1),
        "traced_median_tok_s": round(statistics.median(traced), 1),
        "median_round_ratio": round(statistics.median(ratios), 4),
        "plain_median_cpu_s": round(statistics.median(cpu_plain), 2),
        "traced_median_cpu_s": round(statistics.median(cpu_traced), 2),
        "spans_received": num_spans,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)
    sink = SpanSink()
    sink.server.start()
    try:
        flags = ["--otlp-traces-endpoint", f"http://127.0.0.1:{sink.port}"]
        rows = asyncio.run(
            run(flags, args.rounds, services=("core", "frontend", "worker"), workloads=("W1",))
        )
    finally:
        sink.server.stop(5)
    print(json.dumps(summary(rows["W1"], sink.num_spans)))


if __name__ == "__main__":
    main()

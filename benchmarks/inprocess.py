"""The hop benchmark's in-process server: the public gRPC API served from the in-process engine
(splitserve/inprocess.py), so a benchmark client loads it exactly as it loads a real stack
(`python -m benchmarks.inprocess --model PATH --port N`)."""

from __future__ import annotations

import asyncio

from splitserve.inprocess import EngineSettings, start_in_process


async def serve(
    model: str,
    port: int,
    dtype: str,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    kv_cache_bytes: int,
) -> None:
    """Serve GenerationService from an in-process engine on 127.0.0.1:port until killed."""
    import grpc

    from frontend_svc.server import GenerationServicer
    from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc

    options = EngineSettings.of(
        model,
        dtype=dtype,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        kv_cache_memory_bytes=kv_cache_bytes,
        device="cpu",
        served_model_name="bench",
    )
    frontend = (await start_in_process(options)).frontend
    servicer = GenerationServicer(
        frontend.engine, frontend.inputs, frontend.info, frontend.served_model_name
    )
    server = grpc.aio.server()
    gen_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Serve the public API from an in-process engine.")
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    args = parser.parse_args(argv)
    asyncio.run(
        serve(
            args.model,
            args.port,
            args.dtype,
            args.max_num_seqs,
            args.max_num_batched_tokens,
            args.kv_cache_memory_bytes,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Per-request overhead of the HTTP stack: Starlette + plain dict parsing (what frontend_svc/openai
uses) against FastAPI + a pydantic request model (what vLLM uses), both on uvicorn (httptools).

Each server parses a /v1/completions body of vLLM bench's shape into its request type and returns
a small JSON reply; no engine. One keep-alive client sends the requests one after another, so the
mean round trip is the stack's cost per request. FastAPI is not a splitserve dependency: run with
it importable (e.g. `pip install --target /tmp/fa fastapi; PYTHONPATH=/tmp/fa python -m
benchmarks.http_stack`); without it only the Starlette row is printed.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import time
from typing import Any

BODY = {
    "model": "m",
    "prompt": "The quick brown fox jumps over the lazy dog " * 8,
    "repetition_penalty": 1.0,
    "max_tokens": 64,
    "logprobs": None,
    "temperature": 0.7,
    "top_p": 0.9,
    "stop": ["\n\n"],
    "stream": False,
}


def starlette_app() -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from frontend_svc.openai.fields import read_json
    from frontend_svc.openai.protocol import RequestLimits, parse_completion
    from splitserve_contracts.sampling_rules import Limits

    limits = RequestLimits(Limits(vocab_size=32_000))

    async def completions(request: Request) -> JSONResponse:
        req = parse_completion(await read_json(request), limits)
        return JSONResponse({"id": "x", "max_tokens": req.params.max_tokens})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


def fastapi_app() -> Any:
    from fastapi import FastAPI
    from pydantic import BaseModel

    class CompletionRequest(BaseModel):  # the fields vLLM's CompletionRequest reads most
        model: str | None = None
        prompt: str | list[str] | list[int] | list[list[int]]
        max_tokens: int | None = 16
        temperature: float | None = None
        top_p: float | None = None
        top_k: int | None = None
        min_p: float | None = None
        n: int = 1
        seed: int | None = None
        stop: str | list[str] | None = None
        stream: bool | None = False
        logprobs: int | None = None
        echo: bool | None = False
        presence_penalty: float | None = 0.0
        frequency_penalty: float | None = 0.0
        repetition_penalty: float | None = None
        logit_bias: dict[str, float] | None = None
        user: str | None = None
        min_tokens: int = 0
        ignore_eos: bool = False
        stop_token_ids: list[int] | None = None
        skip_special_tokens: bool = True
        include_stop_str_in_output: bool = False
        prompt_logprobs: int | None = None
        priority: int = 0

    async def completions(req: CompletionRequest) -> dict[str, Any]:
        return {"id": "x", "max_tokens": req.max_tokens}

    # this module's annotations are strings; FastAPI needs the (local) class itself
    completions.__annotations__ = {"req": CompletionRequest, "return": dict[str, Any]}
    app = FastAPI()
    app.post("/v1/completions")(completions)
    return app


def serve(kind: str, port: int) -> None:
    import uvicorn

    app = starlette_app() if kind == "starlette" else fastapi_app()
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", http="httptools")


def measure(port: int, num_requests: int) -> list[float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    payload = json.dumps(BODY)
    headers = {"Content-Type": "application/json"}
    times = []
    for i in range(num_requests + 200):
        started = time.perf_counter()
        conn.request("POST", "/v1/completions", payload, headers)
        reply = conn.getresponse()
        reply.read()
        if reply.status != 200:
            raise RuntimeError(f"status {reply.status}")
        if i >= 200:  # warm-up
            times.append(time.perf_counter() - started)
    conn.close()
    return times


def run(kind: str, port: int, num_requests: int) -> list[float] | None:
    child = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.http_stack", "--serve", kind, "--port", str(port)]
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                return measure(port, num_requests)
            except (ConnectionRefusedError, http.client.RemoteDisconnected):
                if child.poll() is not None or time.monotonic() > deadline:
                    return None
                time.sleep(0.2)
    finally:
        child.terminate()
        child.wait(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", choices=["starlette", "fastapi"])
    parser.add_argument("--port", type=int, default=18431)
    parser.add_argument("--num-requests", type=int, default=3000)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve, args.port)
        return 0
    for kind in ("starlette", "fastapi"):
        times = run(kind, args.port, args.num_requests)
        if times is None:
            print(f"{kind:10s} not available")
            continue
        us = sorted(t * 1e6 for t in times)
        print(
            f"{kind:10s} mean {statistics.mean(us):7.1f} us  p50 {us[len(us) // 2]:7.1f} us  "
            f"p99 {us[int(len(us) * 0.99)]:7.1f} us  ({len(us)} requests)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

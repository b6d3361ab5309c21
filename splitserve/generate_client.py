"""`splitserve generate`: stream a completion from a running frontend to stdout."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import TextIO

import grpc

from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc
from splitserve_runtime.flags import FlagParser, non_negative_int, positive_int

DEFAULT_ADDR = "127.0.0.1:50051"


def build_parser() -> FlagParser:
    p = FlagParser(prog="splitserve generate", description="Stream a completion to stdout.")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--addr", default=DEFAULT_ADDR, help="frontend HOST:PORT")
    p.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user message rendered with the chat template",
    )
    p.add_argument("--max-tokens", type=positive_int, default=64, help="tokens to generate at most")
    p.add_argument("--min-tokens", type=non_negative_int, default=0)
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default 1.0)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--n", type=positive_int, default=1, help="completions to sample")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds")
    return p


def build_request(args: argparse.Namespace) -> gen_pb2.GenerateRequest:
    """Turn parsed `generate` flags into a GenerateRequest."""
    params = types_pb2.SamplingParams(
        n=args.n,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        top_k=args.top_k,
        min_p=args.min_p,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    for name in ("temperature", "top_p", "seed"):
        value = getattr(args, name)
        if value is not None:
            setattr(params, name, value)
    request = gen_pb2.GenerateRequest(sampling_params=params)
    if args.chat:
        request.chat.messages.add(role="user", content=args.prompt)
    else:
        request.prompt = args.prompt
    return request


def has_chat_template(addr: str, timeout: float = 10.0) -> bool:
    """Whether the served model renders chat messages (GetModelInfo)."""
    with grpc.insecure_channel(addr) as channel:
        stub = gen_grpc.GenerationServiceStub(channel)
        info = stub.GetModelInfo(gen_pb2.GetModelInfoRequest(), timeout=timeout)
        return bool(info.has_chat_template)


def stream_text(
    addr: str, request: gen_pb2.GenerateRequest, timeout: float
) -> Iterator[gen_pb2.GenerateResponse]:
    """Yield the frontend's responses for one request."""
    with grpc.insecure_channel(addr) as channel:
        stub = gen_grpc.GenerationServiceStub(channel)
        yield from stub.Generate(request, timeout=timeout)


def print_stream(responses: Iterator[gen_pb2.GenerateResponse], out: TextIO) -> int:
    """Stream completion 0 to `out` as it arrives; print completions 1.. (n > 1) after it.
    Returns the number of completions that finished."""
    later: dict[int, list[str]] = {}
    num_finished = 0
    for response in responses:
        if response.index == 0:
            out.write(response.text)
            out.flush()
        else:
            later.setdefault(response.index, []).append(response.text)
        num_finished += response.finish_reason != types_pb2.FINISH_REASON_UNSPECIFIED
    for index in sorted(later):
        out.write(f"\n--- completion {index} ---\n{''.join(later[index])}")
    out.write("\n")
    out.flush()
    return num_finished


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    args = build_parser().parse(argv, os.environ if environ is None else environ)
    try:
        print_stream(stream_text(args.addr, build_request(args), args.timeout), sys.stdout)
    except grpc.RpcError as err:
        print(f"splitserve generate: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    return 0

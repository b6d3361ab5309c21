"""`splitserve generate`: stream a completion from a running frontend to stdout."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import TextIO

import grpc

from splitserve_client.last_serve import ADDR_HELP, default_address
from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc
from splitserve_runtime.flags import FlagParser, non_negative_int, positive_int


def build_parser() -> FlagParser:
    p = FlagParser(prog="splitserve generate", description="Stream a completion to stdout.")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--addr", default="", help=ADDR_HELP)
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
    p.add_argument(
        "--api-key", default="", help="the frontend's API key (sent as `authorization: Bearer`)"
    )
    p.add_argument(
        "--ssl-ca-certs",
        default="",
        help="PEM CA bundle: connect over TLS, trusting the server certificates it signed",
    )
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


def open_frontend_channel(addr: str, ssl_ca_certs: str = "") -> grpc.Channel:
    """A channel to the frontend: TLS when `ssl_ca_certs` names a CA, else plaintext."""
    if not ssl_ca_certs:
        return grpc.insecure_channel(addr)
    with open(ssl_ca_certs, "rb") as f:
        creds = grpc.ssl_channel_credentials(root_certificates=f.read())
    return grpc.secure_channel(addr, creds)


def auth_metadata(api_key: str) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


def has_chat_template(
    addr: str, timeout: float = 10.0, api_key: str = "", ssl_ca_certs: str = ""
) -> bool:
    """Whether the served model renders chat messages (GetModelInfo)."""
    with open_frontend_channel(addr, ssl_ca_certs) as channel:
        stub = gen_grpc.GenerationServiceStub(channel)
        info = stub.GetModelInfo(
            gen_pb2.GetModelInfoRequest(), timeout=timeout, metadata=auth_metadata(api_key)
        )
        return bool(info.has_chat_template)


def stream_text(
    addr: str,
    request: gen_pb2.GenerateRequest,
    timeout: float,
    api_key: str = "",
    ssl_ca_certs: str = "",
) -> Iterator[gen_pb2.GenerateResponse]:
    """Yield the frontend's responses for one request (TLS when `ssl_ca_certs` names a CA)."""
    with open_frontend_channel(addr, ssl_ca_certs) as channel:
        stub = gen_grpc.GenerationServiceStub(channel)
        yield from stub.Generate(request, timeout=timeout, metadata=auth_metadata(api_key))


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
    env = os.environ if environ is None else environ
    args = build_parser().parse(argv, env)
    addr = args.addr or default_address(env)
    try:
        responses = stream_text(
            addr, build_request(args), args.timeout, args.api_key, args.ssl_ca_certs
        )
        print_stream(responses, sys.stdout)
    except grpc.RpcError as err:
        print(f"splitserve generate: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    return 0

"""The soak's steady mixed load: gRPC and OpenAI HTTP, streaming and not, cancels, n > 1 and a
few bad requests, from a fixed number of client loops. Every outcome is counted; an outcome
that is neither the expected answer nor the expected refusal is an error: a stream or response
must end with a finish reason, and an HTTP stream that carries an error event failed whatever
its status (an SSE stream's status is sent before its first event)."""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import aiohttp
import grpc

from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc

WORDS = ["river", "stone", "light", "token", "engine", "quiet", "paper", "cache", "night", "city"]
MAX_TOKENS = 32


class SoakClients:
    """One gRPC channel and one HTTP session, shared by the client loops."""

    def __init__(self, grpc_addr: str, http_base: str, seed: int = 0) -> None:
        self.http_base = http_base
        self.channel = grpc.aio.insecure_channel(grpc_addr)
        self.stub = gen_grpc.GenerationServiceStub(self.channel)
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300))
        self.rng = random.Random(seed)
        self.outcomes: Counter[str] = Counter()
        self.errors: list[str] = []

    async def close(self) -> None:
        await self.session.close()
        await self.channel.close()

    def _prompt(self) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(1, 64)))

    def _request(self, **params: object) -> gen_pb2.GenerateRequest:
        params.setdefault("max_tokens", self.rng.randint(1, MAX_TOKENS))
        params.setdefault("temperature", self.rng.choice([0.0, 0.7, 1.0]))
        sampling = types_pb2.SamplingParams(**params)  # type: ignore[arg-type]
        return gen_pb2.GenerateRequest(prompt=self._prompt(), sampling_params=sampling)

    async def grpc_stream(self) -> str:
        responses = [r async for r in self.stub.Generate(self._request(), timeout=300)]
        return "grpc_stream" if responses[-1].finish_reason else "grpc_stream_unfinished"

    async def grpc_n(self) -> str:
        request = self._request(
            n=self.rng.randint(2, 4), temperature=1.0, seed=self.rng.randint(0, 99)
        )
        finished = {
            r.index async for r in self.stub.Generate(request, timeout=300) if r.finish_reason
        }
        return "grpc_n" if len(finished) == request.sampling_params.n else "grpc_n_unfinished"

    async def grpc_cancel(self) -> str:
        call = self.stub.Generate(self._request(max_tokens=200, ignore_eos=True), timeout=300)
        async for _ in call:
            break
        call.cancel()
        return "grpc_cancel"

    async def grpc_bad(self) -> str:
        bad: dict[str, object] = self.rng.choice(
            [
                {"top_p": 2.0},
                {"temperature": float("nan")},
                {"stop_token_ids": [10**6]},
                {"min_tokens": 10, "max_tokens": 2},
            ]
        )
        try:
            async for _ in self.stub.Generate(self._request(**bad), timeout=60):
                pass
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                return "grpc_bad_refused"
            raise
        return "grpc_bad_served"

    async def grpc_tokenize(self) -> str:
        ids = await self.stub.Tokenize(gen_pb2.TokenizeRequest(prompt=self._prompt()), timeout=60)
        request = gen_pb2.DetokenizeRequest(token_ids=ids.token_ids)
        await self.stub.Detokenize(request, timeout=60)
        return "grpc_tokenize"

    async def _post(self, path: str, body: object) -> tuple[int, bytes]:
        url = self.http_base + path
        async with self.session.post(url, data=json.dumps(body)) as reply:
            return reply.status, await reply.read()

    async def http_completion(self) -> str:
        body = {"prompt": self._prompt(), "max_tokens": self.rng.randint(1, MAX_TOKENS)}
        status, raw = await self._post("/v1/completions", body)
        if status != 200:
            return f"http_completion_{status}"
        choices = json.loads(raw).get("choices") or [{}]
        return (
            "http_completion" if choices[0].get("finish_reason") else "http_completion_unfinished"
        )

    async def http_chat_stream(self) -> str:
        body = {
            "messages": [{"role": "user", "content": self._prompt()}],
            "max_tokens": self.rng.randint(1, MAX_TOKENS),
            "stream": True,
        }
        status, raw = await self._post("/v1/chat/completions", body)
        if status != 200:
            return f"http_chat_stream_{status}"
        return "http_chat_stream" + sse_problem(raw)

    async def http_bad(self) -> str:
        status, _ = await self._post("/v1/completions", {"prompt": "x", "n": 0})
        return "http_bad_refused" if status == 400 else f"http_bad_{status}"


def sse_problem(raw: bytes) -> str:
    """ "" for a server-sent event stream that finished: some chunk has a finish_reason, no event
    is an error, and it ends with `data: [DONE]`; else the outcome's suffix naming what went
    wrong ("_error: <its message>", "_unfinished")."""
    events = [line[6:] for line in raw.splitlines() if line.startswith(b"data: ")]
    is_finished = False
    for data in events:
        if data == b"[DONE]":
            continue
        event = json.loads(data)
        if "error" in event:
            return f"_error: {event['error'].get('message', '')[:80]}"
        is_finished |= any(c.get("finish_reason") for c in event.get("choices", ()))
    return "" if is_finished and events[-1:] == [b"[DONE]"] else "_unfinished"


Action = Callable[[SoakClients], Awaitable[str]]
MIX: list[tuple[Action, int]] = [
    (SoakClients.grpc_stream, 30),
    (SoakClients.grpc_n, 10),
    (SoakClients.grpc_cancel, 10),
    (SoakClients.grpc_bad, 5),
    (SoakClients.grpc_tokenize, 5),
    (SoakClients.http_completion, 20),
    (SoakClients.http_chat_stream, 15),
    (SoakClients.http_bad, 5),
]
"""Each action with its weight."""
EXPECTED = {
    "grpc_stream", "grpc_n", "grpc_cancel", "grpc_bad_refused", "grpc_tokenize",
    "http_completion", "http_chat_stream", "http_bad_refused",
}  # fmt: skip


async def client_loop(clients: SoakClients, until: float) -> None:
    """Run actions back to back until `until` (time.monotonic())."""
    actions, weights = zip(*MIX, strict=True)
    while time.monotonic() < until:
        action = clients.rng.choices(actions, weights)[0]
        try:
            outcome = detail = await action(clients)
        except (TimeoutError, grpc.aio.AioRpcError, aiohttp.ClientError) as err:
            outcome = f"{action.__name__} failed: {type(err).__name__}"
            detail = f"{outcome}: {err}"
        clients.outcomes[outcome] += 1
        if outcome not in EXPECTED and len(clients.errors) < 100:
            clients.errors.append(detail)

"""A client that behaves as `vllm bench serve --backend openai` / `--backend openai-chat` do.

Written from the behaviour of vLLM's benchmark request functions
(vllm-project/vllm, vllm/benchmarks/lib/endpoint_request_func.py and
vllm/benchmarks/serve.py at commit 02cfb534df5674737558730b10f23d1b7aef9b7c):
- the model comes from `GET /v1/models`: `data[0].id`, and `data[0].root` as the tokenizer path;
- completions POST {model, prompt (text or token ids), repetition_penalty: 1.0, max_tokens,
  logprobs: null, stream: true, stream_options: {include_usage: true}} (+ ignore_eos);
- chat POSTs {model, messages: [{role: user, content: [{type: text, text: prompt}]}],
  max_completion_tokens, stream: true, stream_options: {include_usage: true}} (+ ignore_eos);
- both send `x-request-id`, and `Authorization: Bearer $OPENAI_API_KEY` when set;
- the body is read with aiohttp's `iter_any()`; bytes are split into SSE messages on blank lines
  (a trailing `data: ` message counts once it is `[DONE]` or parses as JSON); `:` comments are
  skipped; a message with non-empty `choices` is a token (the first one is TTFT, later ones
  ITL), one without choices but with `usage` sets output_tokens and prompt_len.
"""

from __future__ import annotations

import codecs
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp


class SseSplitter:
    """Bytes in, complete SSE messages out, the way vLLM's benchmark splits them."""

    def __init__(self) -> None:
        self.pending = ""
        self.decoder = codecs.getincrementaldecoder("utf-8")()

    def feed(self, data: bytes) -> list[str]:
        self.pending += self.decoder.decode(data)
        messages = []
        while "\n\n" in self.pending:
            message, self.pending = self.pending.split("\n\n", 1)
            if message.strip():
                messages.append(message.strip())
        if self.pending.startswith("data: "):
            content = self.pending[len("data: ") :].strip()
            if content == "[DONE]" or (content and _is_json(content)):
                messages.append(self.pending.strip())
                self.pending = ""
        return messages


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


@dataclass
class BenchResult:
    success: bool = False
    error: str = ""
    generated_text: str = ""
    output_tokens: int = 0
    prompt_len: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0


async def first_model(base_url: str) -> tuple[str, str]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{base_url}/v1/models") as response,
    ):
        response.raise_for_status()
        data = await response.json()
        return data["data"][0]["id"], data["data"][0]["root"]


def payload(
    backend: str, model: str, prompt: str | list[int], output_len: int, ignore_eos: bool
) -> dict[str, Any]:
    body: dict[str, Any]
    if backend == "openai-chat":
        content = [{"type": "text", "text": prompt}]
        body = {"model": model, "messages": [{"role": "user", "content": content}]}
        body["max_completion_tokens"] = output_len
    else:
        body = {"model": model, "prompt": prompt, "repetition_penalty": 1.0}
        body |= {"max_tokens": output_len, "logprobs": None}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def _text(backend: str, choice: dict[str, Any]) -> str:
    value = choice["delta"].get("content") if backend == "openai-chat" else choice.get("text")
    return value or ""


async def request(
    session: aiohttp.ClientSession, base_url: str, backend: str, body: dict[str, Any], rid: str
) -> BenchResult:
    path = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    headers = {"x-request-id": rid}
    if backend == "openai-chat":
        headers["Content-Type"] = "application/json"
    if os.environ.get("OPENAI_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
    result = BenchResult()
    start = last = time.perf_counter()
    async with session.post(f"{base_url}{path}", json=body, headers=headers) as response:
        if response.status != 200:
            result.error = response.reason or str(response.status)
            return result
        splitter = SseSplitter()
        async for data in response.content.iter_any():
            if not data.strip():
                continue
            for message in splitter.feed(data.strip()):
                if message.startswith(":"):
                    continue
                chunk = message.removeprefix("data: ")
                if chunk == "[DONE]":
                    continue
                parsed = json.loads(chunk)
                now = time.perf_counter()
                if choices := parsed.get("choices"):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.generated_text += _text(backend, choices[0])
                elif usage := parsed.get("usage"):
                    result.output_tokens = usage.get("completion_tokens")
                    result.prompt_len = usage.get("prompt_tokens", result.prompt_len)
    result.success = result.ttft > 0.0
    result.latency = last - start
    return result

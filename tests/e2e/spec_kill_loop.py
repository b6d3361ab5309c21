"""The TP=2 speculative rank-kill test in a loop, with the prompts, the seeds, the killed rank and
the moment of the kill varied; every divergence is logged with its token index, what each
stream had when the rank died, and whether that token was a near-tie.

    python -m tests.e2e.spec_kill_loop --variants 8 --out /tmp/spec-kill.jsonl

Per variant (other prompts and seeds: tests/e2e/test_recovery.request): the plain TP=1 stack's
tokens (the greedy reference), one undisturbed run of the speculative TP=2 stack, then one run
per kill timing: `tokens:K` (some stream has K tokens), `total:N` (N tokens streamed in all),
both once the core holds every request (test_recovery.run_streams_killing), or `delay:S` (S
seconds after the requests went out, while they still arrive: those that reach the core during
the recovery are refused with UNAVAILABLE, as designed, and are counted apart). Greedy streams
are compared with the reference and every stream with the undisturbed run; the greedy tokens
that lead their runner-up by less than MIN_GREEDY_MARGIN in transformers' fp32 logits are
listed per variant, so a divergence there reads as rounding, not as the resume path.
tests/e2e/test_spec_decode.py keeps four of these kills.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import grpc

from splitserve.supervisor import Supervisor
from tests.e2e.stack import Stack
from tests.e2e.test_recovery import (
    MAX_TOKENS,
    MIN_GREEDY_MARGIN,
    NUM_STREAMS,
    Streams,
    greedy_margins,
    metric,
    run_streams,
    run_streams_killing,
    wait_idle,
    wait_until,
)

KILL_TIMINGS = (
    "tokens:1",
    "tokens:4",
    "tokens:9",
    "tokens:17",
    "tokens:26",
    "delay:0.05",
    "delay:0.4",
    "total:300",
    "total:600",
)


def first_difference(got: list[int], want: list[int]) -> int:
    for index, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return index
    return min(len(got), len(want))


def compare(got: list[list[int]], want: list[list[int]], streams: range) -> list[dict[str, object]]:
    return [
        {"stream": i, "index": first_difference(got[i], want[i]), "got": got[i], "want": want[i]}
        for i in streams
        if got[i] != want[i]
    ]


def killed_run(spec: Stack, variant: int, timing: str, rank: int) -> tuple[Streams, list[int]]:
    """One run with `rank` killed at `timing`; returns the streams and each one's token count
    at the kill."""
    core = spec.child("core")
    before = metric(core, "splitserve_engine_recoveries_total", cause="rank_died")
    if timing.startswith("delay:"):
        process = spec.child(f"worker[{rank}]").process
        started = time.monotonic()
        streams = Streams(spec.frontend, variant)
        time.sleep(max(0.0, started + float(timing.split(":")[1]) - time.monotonic()))
        at_kill = [len(t) for t in streams.tokens]
        process.send_signal(signal.SIGKILL)
        streams.join()
    else:
        streams, at_kill = run_streams_killing(spec, rank, timing, variant)
    wait_until(
        lambda: metric(core, "splitserve_engine_recoveries_total", cause="rank_died") > before,
        60,
        "no recovery counted",
    )
    wait_idle(spec)
    return streams, at_kill


def refused(streams: Streams) -> set[int]:
    """Streams refused at once while the engine recovered (UNAVAILABLE before any token)."""
    return {
        i
        for i, err in streams.errors.items()
        if err.code() == grpc.StatusCode.UNAVAILABLE and not streams.tokens[i]
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--variants", type=int, default=6)
    parser.add_argument("--first-variant", type=int, default=0)
    parser.add_argument("--timings", default=",".join(KILL_TIMINGS))
    parser.add_argument("--ranks", default="1", help="the ranks killed, in turn (e.g. 1 or 0,1)")
    parser.add_argument("--async-scheduling", action="store_true", help="not --no-async-...")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("/tmp/spec-kill-loop.jsonl"))
    args = parser.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    from frontend_svc.inputs.input_processor import load_tokenizer
    from splitserve_runtime.tiny_model import ensure_tiny_model
    from tests.e2e.test_spec_decode import SMALL_KV_BYTES, SPEC_FLAGS

    model = ensure_tiny_model({})
    hf_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(str(model))
    plain = Stack(model).start()
    flags = [*SPEC_FLAGS, "--kv-cache-memory-bytes", SMALL_KV_BYTES]
    if not args.async_scheduling:
        flags.append("--no-async-scheduling")
    spec = Stack(model, tp=args.tp, core_flags=flags).start()
    spec.supervisor = Supervisor(spec.children, max_restarts=1 << 20).start()  # every kill
    timings = args.timings.split(",")
    ranks = [int(r) for r in args.ranks.split(",")]
    runs = diverged = num_refused = 0
    greedy = range(0, NUM_STREAMS, 2)
    try:
        with args.out.open("a") as log:
            for variant in range(args.first_variant, args.first_variant + args.variants):
                near_ties = [
                    {"stream": i, "index": index, "lead": lead}
                    for lead, i, index in greedy_margins(hf_model, tokenizer, variant)
                    if lead < MIN_GREEDY_MARGIN
                ]
                reference = run_streams(plain.frontend, variant=variant).tokens
                undisturbed = run_streams(spec.frontend, variant=variant)
                assert not undisturbed.errors
                found = compare(undisturbed.tokens, reference, greedy)
                entry = {"variant": variant, "kill": None, "near_ties": near_ties}
                log.write(json.dumps({**entry, "vs_reference": found}) + "\n")
                diverged += bool(found)
                for n, timing in enumerate(timings):
                    rank = ranks[(variant + n) % len(ranks)]
                    streams, at_kill = killed_run(spec, variant, timing, rank)
                    runs += 1
                    skip = refused(streams)
                    num_refused += len(skip)
                    errors = {i: str(e.code()) for i, e in streams.errors.items() if i not in skip}
                    short = [
                        i
                        for i, t in enumerate(streams.tokens)
                        if i not in skip and len(t) != MAX_TOKENS
                    ]
                    kept = [i for i in range(NUM_STREAMS) if i not in skip]
                    vs_undisturbed = compare(streams.tokens, undisturbed.tokens, range(NUM_STREAMS))
                    vs_undisturbed = [d for d in vs_undisturbed if d["stream"] in kept]
                    vs_reference = [
                        d for d in compare(streams.tokens, reference, greedy) if d["stream"] in kept
                    ]
                    bad = bool(errors or short or vs_undisturbed or vs_reference)
                    diverged += bad
                    log.write(
                        json.dumps(
                            {
                                "variant": variant,
                                "kill": timing,
                                "rank": rank,
                                "at_kill": at_kill,
                                "refused": sorted(skip),
                                "errors": errors,
                                "vs_undisturbed": vs_undisturbed,
                                "vs_reference": vs_reference,
                            }
                        )
                        + "\n"
                    )
                    log.flush()
                    print(
                        f"variant {variant} kill {timing} rank {rank} (tokens at kill: max "
                        f"{max(at_kill)}, total {sum(at_kill)}; {len(skip)} refused): "
                        f"{'DIVERGED' if bad else 'ok'}",
                        flush=True,
                    )
    finally:
        spec.stop()
        plain.stop()
    print(
        f"{runs} killed runs, {diverged} with a divergence or an error, {num_refused} requests "
        "refused during a recovery",
        flush=True,
    )
    return 1 if diverged else 0


if __name__ == "__main__":
    sys.exit(main())

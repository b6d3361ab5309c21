"""The oracle hit rate of a run of the scale-out benchmark (benchmarks/scaleout.py): what one
engine with an infinite prefix cache would have hit on the prompts the run actually sent.

Each request's prompt is rebuilt after the run (the chat template over its messages, with the
answers the run got), in arrival order; its hit is the longest run of leading full blocks seen
in any earlier prompt (block hashes chained as the prefix cache chains them), at most the
prompt's length - 1 (the last token is always computed, as vLLM does); then its full blocks are
cached. Unlike SP-MT's ideal rate (benchmarks/scaleout_workload.Shape.ideal_hit_rate) this counts
the chat template's tokens and block rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from benchmarks.scaleout_workload import Workload

Encode = Callable[[list[dict[str, str]]], Sequence[int]]
"""Chat messages -> the prompt's token ids (the served model's chat template)."""


def oracle_hit_rate(workload: Workload, encode: Encode, block_size: int = 16) -> float:
    seen: set[int] = set()
    hits = total = 0
    sessions = {id(t): s for s in workload.sessions for t in s.turns}
    for turn in workload.order:
        ids = encode(sessions[id(turn)].messages(turn.index))
        chain, num_hit, hitting = 0, 0, True
        for start in range(0, len(ids) - block_size + 1, block_size):
            chain = hash((chain, tuple(ids[start : start + block_size])))
            if hitting and chain in seen:
                num_hit = start + block_size
            else:
                hitting = False
                seen.add(chain)
        hits += min(num_hit, len(ids) - 1)
        total += len(ids)
    return hits / total if total else 0.0

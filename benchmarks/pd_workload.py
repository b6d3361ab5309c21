"""The prefill/decode benchmark's workload (benchmarks/pd.py): ~16 decodes streaming while long
prompts (1.5-2k tokens) arrive, as text over `/v1/completions` through the gateway (smg takes
no token-id prompts), greedy with EOS ignored, so every variant must produce the same text.

Sized for the 45-minute rule on 2 cores (issue 39: <= 40 minutes for 3 rounds of both variants):
16 decodes x 160 tokens and 8 long prompts x 16 tokens, the long ones every 2.5 s from t = 3 s,
take ~30-40 s a run on two one-thread SmolLM2 engines; a variant's start-up ~30 s.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.peer_workloads import seeded
from benchmarks.scaleout_workload import text

NUM_DECODES = 16
DECODE_PROMPT_WORDS = 48
DECODE_TOKENS = 160
NUM_LONG = 8
LONG_TOKENS = 16
LONG_WORDS = (1500, 2000)
"""Words of a long prompt: each is one token (benchmarks/scaleout_workload.single_token_words)."""
LONG_START_S = 3.0
LONG_EVERY_S = 2.5
DECODE_STAGGER_S = 0.1


@dataclass(frozen=True)
class PdRequest:
    """One request: a text prompt, its output length, when it is sent, whether it is long."""

    prompt: str
    max_tokens: int
    arrival_s: float
    is_long: bool


def build_workload(words: list[str], seed: int) -> list[PdRequest]:
    """The decodes first (staggered), then the long prompts; prompts unique per seed (no prefix
    is shared, so routing policy cannot matter)."""
    rng = seeded(seed, "pd")
    requests = [
        PdRequest(text(rng, words, DECODE_PROMPT_WORDS), DECODE_TOKENS, i * DECODE_STAGGER_S, False)
        for i in range(NUM_DECODES)
    ]
    for i in range(NUM_LONG):
        count = rng.randint(*LONG_WORDS)
        arrival = LONG_START_S + i * LONG_EVERY_S
        requests.append(PdRequest(text(rng, words, count), LONG_TOKENS, arrival, True))
    return requests

"""The scale-out benchmark's workloads (benchmarks/scaleout.py), as chat sessions. Pure: no I/O.

SP-MT-16: 16 groups, each with its own shared 1,024-token system prompt; 4 sessions per group, 3
turns each. A turn adds a 64-token user message to its session's history (the system prompt, the
earlier user messages and the assistant's earlier answers) and asks for 32 tokens (ignore_eos).
The 192 requests arrive as a Poisson process in a random interleaving of the sessions; a turn
waits for its session's previous answer (it needs it in its history).

Working set (distinct prompt tokens): 16 x 1,024 + 64 x (3 x 64 + 2 x 32) = 32,768 tokens, of
227,328 prompt tokens in all; an ideal cache misses only the first sight of each token, a
hit rate of 1 - 32,768 / 227,328 = 85.6 % (before chat-template tokens and block rounding).

The control (no sharing) has the same 192 requests with the same prompt lengths, each a system
prompt and a user message of its own, no history: nothing any cache can reuse.

Words are single tokens of the served model's vocabulary (a space and a lowercase word), so that
N words are N tokens.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

NUM_GROUPS, SESSIONS_PER_GROUP, NUM_TURNS = 16, 4, 3
PREFIX_TOKENS, USER_TOKENS, OUTPUT_TOKENS = 1024, 64, 32


@dataclass
class Turn:
    """One request: the session it belongs to, its turn, its new user message, when it is due."""

    session: int
    index: int
    user: str
    arrival_s: float = 0.0


@dataclass
class Session:
    """A conversation: its system prompt and turns; `answers` fill in as the replies come."""

    system: str
    turns: list[Turn]
    answers: list[str] = field(default_factory=list)
    keep_history: bool = True

    def messages(self, turn: int) -> list[dict[str, str]]:
        """The chat messages of turn `turn`: system prompt, history, the new user message."""
        messages = [{"role": "system", "content": self.system}]
        if self.keep_history:
            for earlier, answer in zip(self.turns[:turn], self.answers, strict=False):
                messages += [{"role": "user", "content": earlier.user}]
                messages += [{"role": "assistant", "content": answer}]
        return [*messages, {"role": "user", "content": self.turns[turn].user}]


@dataclass
class Workload:
    name: str
    sessions: list[Session]
    order: list[Turn]
    """Every turn, in arrival order."""


def single_token_words(vocab: Iterable[str], encode: object) -> list[str]:
    """Lowercase words w for which " w" is one token (`encode(text) -> ids`, no special
    tokens), sorted; from a byte-level BPE vocabulary ("Ġword" entries)."""
    words = sorted(
        {t[1:] for t in vocab if t.startswith("Ġ") and t[1:].isalpha() and t[1:].islower()}
    )
    return [w for w in words if 3 <= len(w) <= 8 and len(encode(" " + w)) == 1]  # type: ignore[operator]


def text(rng: random.Random, words: Sequence[str], num_tokens: int) -> str:
    return " ".join(rng.choices(words, k=num_tokens))


def poisson_arrivals(turns: list[Turn], rate: float, rng: random.Random) -> None:
    """Arrival times of a Poisson process of `rate` requests/s, in `turns`' order."""
    now = 0.0
    for turn in turns:
        turn.arrival_s = now
        now += rng.expovariate(rate)


def interleave(sessions: Sequence[Session], rng: random.Random) -> list[Turn]:
    """All turns in a random interleaving that keeps each session's turns in order."""
    cursors = [0] * len(sessions)
    pending = [i for i, s in enumerate(sessions) for _ in s.turns]
    rng.shuffle(pending)
    order = []
    for i in pending:
        order.append(sessions[i].turns[cursors[i]])
        cursors[i] += 1
    return order


@dataclass(frozen=True)
class Shape:
    """How many groups and sessions (SP-MT-16: 16 x 4; a smoke run takes fewer)."""

    num_groups: int = NUM_GROUPS
    sessions_per_group: int = SESSIONS_PER_GROUP

    @property
    def num_sessions(self) -> int:
        return self.num_groups * self.sessions_per_group

    def working_set_tokens(self) -> int:
        """Distinct prompt tokens of SP-MT-16 (the KV capacity is sized against it)."""
        history = NUM_TURNS * USER_TOKENS + (NUM_TURNS - 1) * OUTPUT_TOKENS
        return self.num_groups * PREFIX_TOKENS + self.num_sessions * history


def sp_mt_16(words: Sequence[str], rate: float, seed: int = 0, shape: Shape = Shape()) -> Workload:
    rng = random.Random(seed)
    sessions: list[Session] = []
    for _ in range(shape.num_groups):
        system = text(rng, words, PREFIX_TOKENS)
        for _ in range(shape.sessions_per_group):
            number = len(sessions)
            turns = [Turn(number, t, text(rng, words, USER_TOKENS)) for t in range(NUM_TURNS)]
            sessions.append(Session(system, turns))
    order = interleave(sessions, rng)
    poisson_arrivals(order, rate, rng)
    return Workload("SP-MT-16", sessions, order)


def no_sharing(
    words: Sequence[str], rate: float, seed: int = 0, shape: Shape = Shape()
) -> Workload:
    """The control: SP-MT-16's prompt lengths (turn t: the prefix, t + 1 user messages and t
    answers' worth of tokens), every prompt its own."""
    rng = random.Random(seed + 1)
    sessions: list[Session] = []
    for _ in range(shape.num_sessions):
        for t in range(NUM_TURNS):
            user = text(rng, words, (t + 1) * USER_TOKENS + t * OUTPUT_TOKENS)
            number = len(sessions)
            system = text(rng, words, PREFIX_TOKENS)
            sessions.append(Session(system, [Turn(number, 0, user)], keep_history=False))
    order = [s.turns[0] for s in sessions]
    rng.shuffle(order)
    poisson_arrivals(order, rate, rng)
    return Workload("no-sharing", sessions, order)

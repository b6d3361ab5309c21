"""The scale-out benchmark's workloads (benchmarks/scaleout.py), as chat sessions. Pure: no I/O.

SP-MT (a shared-prefix multi-turn workload): groups of sessions, each group with its own shared
system prompt; each session has a few turns, a turn adds a user message to its session's history
(the system prompt, the earlier user messages and the assistant's earlier answers) and asks for
a fixed number of tokens (ignore_eos). The requests arrive as a Poisson process in a random
interleaving of the sessions; a turn waits for its session's previous answer (it needs it in
its history). Two shapes (`Shape`):

- SP-MT-16, the full one (for a machine with more cores: `--shape full`): 16 groups sharing a
  1,024-token prefix, 4 sessions x 3 turns, 64-token user messages, 32 output tokens; 192
  requests; working set (distinct prompt tokens) 16 x 1,024 + 64 x (3 x 64 + 2 x 32) = 32,768
  tokens of 227,328 prompt tokens: an ideal cache's hit rate is 85.6 %.
- SP-MT-8, the scaled one (the default): every length halved (512-token prefixes, 32-token user
  messages, 16 output tokens) and half the groups (8), sessions per group and turns kept; 96
  requests; working set 8 x 512 + 32 x (3 x 32 + 2 x 16) = 8,192 tokens of 56,832: the same
  85.6 % ideal hit rate, since every term of both sums scales by the same factor per group.

The control (no sharing) has SP-MT's prompt lengths, each a system prompt and a user message of
its own, no history: nothing any cache can reuse. The returning sessions (`returning`) are new
one-turn sessions of an SP-MT run's groups: their system prompt is the group's, the rest new.

Words are single tokens of the served model's vocabulary (a space and a lowercase word), so that
N words are N tokens.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


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
    output_tokens: int


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
    """An SP-MT workload's size."""

    name: str
    num_groups: int
    sessions_per_group: int
    num_turns: int
    prefix_tokens: int
    user_tokens: int
    output_tokens: int

    @property
    def num_sessions(self) -> int:
        return self.num_groups * self.sessions_per_group

    @property
    def num_requests(self) -> int:
        return self.num_sessions * self.num_turns

    def prompt_tokens(self, turn: int) -> int:
        """Turn `turn`'s prompt: the prefix, turn + 1 user messages, turn answers (no template)."""
        return self.prefix_tokens + (turn + 1) * self.user_tokens + turn * self.output_tokens

    @property
    def max_model_len(self) -> int:
        """What every request fits in: twice one more turn's prompt than the last, which covers
        the chat template's tokens and the answer."""
        return 2 * self.prompt_tokens(self.num_turns)

    def working_set_tokens(self) -> int:
        """Distinct prompt tokens (the KV capacity is sized against it)."""
        history = self.num_turns * self.user_tokens + (self.num_turns - 1) * self.output_tokens
        return self.num_groups * self.prefix_tokens + self.num_sessions * history

    def ideal_hit_rate(self) -> float:
        """An infinite cache's token hit rate: 1 - working set / prompt tokens (before the chat
        template's tokens and block rounding)."""
        total = self.num_sessions * sum(self.prompt_tokens(t) for t in range(self.num_turns))
        return 1 - self.working_set_tokens() / total


FULL = Shape("SP-MT-16", 16, 4, 3, 1024, 64, 32)
SCALED = Shape("SP-MT-8", 8, 4, 3, 512, 32, 16)
SHAPES = {"full": FULL, "scaled": SCALED}


def sp_mt(words: Sequence[str], rate: float, seed: int, shape: Shape) -> Workload:
    rng = random.Random(seed)
    sessions: list[Session] = []
    for _ in range(shape.num_groups):
        system = text(rng, words, shape.prefix_tokens)
        for _ in range(shape.sessions_per_group):
            number = len(sessions)
            turns = [Turn(number, t, text(rng, words, shape.user_tokens))
                     for t in range(shape.num_turns)]  # fmt: skip
            sessions.append(Session(system, turns))
    order = interleave(sessions, rng)
    poisson_arrivals(order, rate, rng)
    return Workload(shape.name, sessions, order, shape.output_tokens)


def no_sharing(
    words: Sequence[str], rate: float, seed: int, shape: Shape, num_requests: int = 0
) -> Workload:
    """The control: SP-MT's prompt lengths (`num_requests` of them, 0: as many as SP-MT's),
    every prompt its own."""
    rng = random.Random(seed + 1)
    sessions: list[Session] = []
    for _ in range(num_requests or shape.num_requests):
        t = len(sessions) % shape.num_turns
        user = text(rng, words, shape.prompt_tokens(t) - shape.prefix_tokens)
        system = text(rng, words, shape.prefix_tokens)
        sessions.append(Session(system, [Turn(len(sessions), 0, user)], keep_history=False))
    order = [s.turns[0] for s in sessions]
    rng.shuffle(order)
    poisson_arrivals(order, rate, rng)
    return Workload("no-sharing", sessions, order, shape.output_tokens)


def returning(
    words: Sequence[str], earlier: Workload, rate: float, seed: int, shape: Shape
) -> Workload:
    """New one-turn sessions of `earlier`'s groups (`sessions_per_group` each): the group's
    system prompt, a new user message; shuffled, Poisson arrivals."""
    rng = random.Random(seed + 2)
    systems = list(dict.fromkeys(s.system for s in earlier.sessions))
    sessions: list[Session] = []
    for system in systems:
        for _ in range(shape.sessions_per_group):
            user = text(rng, words, shape.user_tokens)
            sessions.append(Session(system, [Turn(len(sessions), 0, user)]))
    order = [s.turns[0] for s in sessions]
    rng.shuffle(order)
    poisson_arrivals(order, rate, rng)
    return Workload("returning", sessions, order, shape.output_tokens)

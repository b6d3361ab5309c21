"""One request's grammar state in the engine core (vLLM's StructuredOutputRequest): its matcher,
the cached grammar it was copied from, and how a refused token or a failed matcher ends it.

A matcher stops when its grammar is complete and also when it fails (one of llguidance's limits:
`((a|aa){50}){50}`'s lexer outgrows one on its first `a`): only the first finishes the request
(STOP); a failure fails it (INVALID_REQUEST, naming llguidance's reason), and its cached grammar
is compiled anew for the next request (copies share the lexer that hit the limit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import llguidance

from splitserve_contracts.output_types import ErrorKind
from splitserve_contracts.structured_outputs import (
    InvalidStructuredOutputs,
    StructuredOutputsParams,
)
from splitserve_runtime.grammars import summary


class StructuredOutputRequest:
    """One request's grammar state (vLLM's StructuredOutputRequest): its matcher, once compiled.

    `reasoning_ended` is the hook for reasoning models (vLLM's `reasoning_ended`): while False
    the request samples unconstrained and its tokens are not fed to the matcher;
    `reasoning_end_token_id`, when set, flips it once that token is generated (a reasoning
    parser in the frontend sets it, e.g. the id of `</think>`), and the grammar starts there.
    """

    __slots__ = (
        "params",
        "matcher",
        "reasoning_ended",
        "reasoning_end_token_id",
        "template",
        "failure",
    )

    def __init__(
        self, params: StructuredOutputsParams, reasoning_end_token_id: int | None = None
    ) -> None:
        self.params = params
        self.matcher: llguidance.LLMatcher | None = None
        self.reasoning_end_token_id = reasoning_end_token_id
        self.reasoning_ended = reasoning_end_token_id is None
        self.template: CompiledGrammar | None = None
        """The cached grammar its matcher was copied from."""
        self.failure: str | None = None
        """Set by the step's fill when the grammar cannot go on with a token this model can
        emit: the request fails with it (INVALID_REQUEST) when that step's token comes back,
        and the token, sampled under a row that allowed everything, is dropped."""

    @property
    def needs_bitmask(self) -> bool:
        """Whether its next token is constrained (compiled, past reasoning, not complete)."""
        matcher = self.matcher
        return self.reasoning_ended and matcher is not None and not matcher.is_stopped()

    @property
    def may_need_bitmask(self) -> bool:
        """Whether its next token may be constrained: needs_bitmask, or still reasoning (the
        token before it, in flight under async scheduling, may end the reasoning)."""
        matcher = self.matcher
        return matcher is not None and not matcher.is_stopped()

    def accept(self, token_id: int) -> bool:
        """Advance the matcher by one applied token; False when it refused the token or failed
        (the request must fail: `refusal` says how). A failed matcher "consumes" an EOS token
        (llguidance), so its error is checked too: it never passes for a complete grammar."""
        if not self.reasoning_ended:
            self.reasoning_ended = token_id == self.reasoning_end_token_id
            return True
        matcher = self.matcher
        assert matcher is not None
        return matcher.consume_token(token_id) and not matcher.is_error()

    def refusal(self, token_id: int, was_allowed: bool) -> tuple[ErrorKind, str]:
        """Why accept refused `token_id`, by whether the step's mask allowed it: if not, the rank
        sampled a token the grammar does not allow (ENGINE_FAILURE); if so, the matcher failed on
        a token its own mask allowed (one of llguidance's limits, or an added token it refuses
        once spelled out): the grammar cannot be followed, a non-retryable INVALID_REQUEST
        naming llguidance's reason."""
        if not was_allowed:
            return ErrorKind.ENGINE_FAILURE, (
                f"the output rank sampled token {token_id}, which the request's grammar "
                "does not allow"
            )
        return ErrorKind.INVALID_REQUEST, self.matcher_failure()

    def matcher_failure(self) -> str:
        """The failed matcher's error as the request's message. Its cached grammar is spent:
        copies share the lexer that may have hit the limit, so the next request compiles anew
        (one request's exhaustion does not fail the ones after it)."""
        matcher = self.matcher
        assert matcher is not None
        if self.template is not None:
            self.template.is_spent = True
        error = matcher.get_error()
        reason = summary([error]) if error.strip() else f"it stopped ({matcher.stop_reason()})"
        return InvalidStructuredOutputs(
            f"the grammar could not be followed: {reason}", self.params.kind
        ).describe()

    def after_reasoning(self, output_token_ids: Sequence[int]) -> list[int]:
        """The tokens of `output_token_ids` (a resubmitted request's outputs) its matcher must
        consume: all of them once reasoning ended, else those after the first reasoning end
        token among them (which ends the reasoning now), else none."""
        tokens = list(output_token_ids)
        if self.reasoning_ended:
            return tokens
        end_id = self.reasoning_end_token_id
        if end_id is None or end_id not in tokens:
            return []
        self.reasoning_ended = True
        return tokens[tokens.index(end_id) + 1 :]

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete (after accept took a token): nothing more may follow (the
        request finishes, STOP)."""
        return self.reasoning_ended and self.matcher is not None and self.matcher.is_stopped()


@dataclass(slots=True)
class CompiledGrammar:
    """A cached grammar: the matcher requests copy, and the width of its masks."""

    matcher: llguidance.LLMatcher
    vocab_size: int
    """Its tokenizer's ids, as llguidance has them (at least the model's vocabulary)."""
    is_spent: bool = False
    """A copy failed (StructuredOutputRequest.matcher_failure): compile it anew."""

"""`--enable-log-requests` (vLLM's name): one log line per finished request.

    Finished request cmpl-1a2b: prompt_tokens=12, output_tokens=34, cached_tokens=0,
    finish_reason=stop, ttft=0.041s, latency=0.532s

(one line). n > 1 sums the completions' output tokens and lists each finish reason. The prompt's
text is never logged unless `--max-log-len N` asks for its first N characters.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from frontend_svc.engine.detokenizer import Decoder
from frontend_svc.requests import CompletionDelta, EngineRequest
from splitserve_contracts.output_types import FinishReason

logger = logging.getLogger("frontend_svc.requests")


@dataclass(slots=True)
class RequestOutcome:
    """What a request's deltas said, per completion index."""

    arrival: float
    num_completions: int
    num_output_tokens: dict[int, int] = field(default_factory=dict)
    num_cached_tokens: int = 0
    finish_reasons: dict[int, FinishReason] = field(default_factory=dict)
    first_token_time: float | None = None

    def observe(self, delta: CompletionDelta) -> None:
        if self.first_token_time is None and delta.token_ids:
            self.first_token_time = time.monotonic()
        self.num_output_tokens[delta.index] = delta.completion_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, delta.cached_tokens)
        if delta.is_finished:
            self.finish_reasons[delta.index] = delta.finish_reason

    def reasons(self, unfinished: FinishReason) -> str:
        """Each completion's finish reason; `unfinished` for those that never finished."""
        return ",".join(
            str(self.finish_reasons.get(index, unfinished)) for index in range(self.num_completions)
        )


class RequestLogger:
    """Writes the line; `decoder` turns the prompt's first tokens back into text when
    `max_log_len` > 0."""

    def __init__(self, decoder: Decoder, max_log_len: int = 0) -> None:
        self.decoder = decoder
        self.max_log_len = max_log_len

    def start(self, request: EngineRequest, arrival: float) -> RequestOutcome:
        return RequestOutcome(arrival, request.params.n)

    def finished(
        self, request: EngineRequest, outcome: RequestOutcome, unfinished: FinishReason
    ) -> None:
        now = time.monotonic()
        ttft = "-"
        if outcome.first_token_time is not None:
            ttft = f"{outcome.first_token_time - outcome.arrival:.3f}s"
        prompt = ""
        if self.max_log_len > 0:
            ids = request.prompt_token_ids[: self.max_log_len]
            text = self.decoder.decode(ids, False)[: self.max_log_len]
            prompt = f", prompt={text!r}"
        logger.info(
            "Finished request %s: prompt_tokens=%d, output_tokens=%d, cached_tokens=%d, "
            "finish_reason=%s, ttft=%s, latency=%.3fs%s",
            request.request_id,
            len(request.prompt_token_ids),
            sum(outcome.num_output_tokens.values()),
            outcome.num_cached_tokens,
            outcome.reasons(unfinished),
            ttft,
            now - outcome.arrival,
            prompt,
        )

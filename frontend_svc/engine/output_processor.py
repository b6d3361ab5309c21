"""OutputProcessor: turn the core's per-step token ids into per-completion text deltas.

One loop over each step's outputs: detokenize incrementally, check stop strings (also across
token boundaries), hold back text that could still become a stop string, convert logprobs, and
hand each delta to its request's queue. Requests a stop string finished are returned so the
caller can abort them in the core.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from frontend_svc.engine.detokenizer import Decoder, IncrementalDetokenizer
from frontend_svc.engine.engine_types import CoreOutputDetail, CoreOutputs
from frontend_svc.engine.stop_strings import find_stop_string, stop_buffer_length
from frontend_svc.errors import EngineUnavailable, Overloaded
from frontend_svc.metrics import FrontendMetrics, RequestStats
from frontend_svc.requests import CompletionDelta, EngineRequest, Logprob, TokenLogprobs
from frontend_svc.tracing import RequestTracer
from splitserve_contracts.output_types import ErrorKind, FinishReason, LogprobsTable
from splitserve_contracts.sampling_types import SamplingParams

MAX_UNREAD_DELTAS = 4096
"""A request whose client leaves this many updates unread is stopped: the engine must not keep
generating (and holding KV blocks) for a client that never reads."""


@dataclass(slots=True)
class RequestState:
    """Frontend-side state of one engine request (one completion index)."""

    handle: int
    index: int
    params: SamplingParams
    num_prompt_tokens: int
    queue: asyncio.Queue[Any]
    detokenizer: IncrementalDetokenizer
    stats: RequestStats
    text: str = ""
    num_sent_chars: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    is_finished: bool = False
    request: EngineRequest | None = None
    """What was sent to the engine core, kept to resubmit it to a restarted core."""
    span: Any = None
    """Its llm_request span when traced (frontend_svc/tracing.py)."""
    first_output_at: float | None = None
    """time.monotonic() of its first tokens (traced requests only)."""


def _grammar_ended(state: RequestState, last_token_id: int) -> bool:
    """A constrained request stopped because its grammar is complete: its last token is
    output, unless it is EOS or a stop token id."""
    request = state.request
    if request is None or request.structured_outputs is None:
        return False
    return last_token_id != request.eos_token_id and (
        last_token_id not in state.params.stop_token_ids
    )


class OutputProcessor:
    """Owns the RequestStates of live requests, keyed by their core handle."""

    def __init__(
        self, decoder: Decoder, metrics: FrontendMetrics, tracer: RequestTracer | None = None
    ) -> None:
        self.decoder = decoder
        self.metrics = metrics
        self.tracer = tracer
        self.states: dict[int, RequestState] = {}

    def add_request(
        self,
        handle: int,
        index: int,
        params: SamplingParams,
        num_prompt_tokens: int,
        queue: asyncio.Queue[Any],
        arrival: float | None = None,
        request: EngineRequest | None = None,
    ) -> RequestState:
        detok = IncrementalDetokenizer(self.decoder, params.skip_special_tokens)
        stats = RequestStats(arrival or time.monotonic(), num_prompt_tokens)
        state = RequestState(handle, index, params, num_prompt_tokens, queue, detok, stats)
        state.request = request
        self.states[handle] = state
        self._count_in_flight()
        return state

    def remove_request(self, handle: int) -> None:
        """Forget a request the caller gave up on (counted as aborted)."""
        state = self.states.pop(handle, None)
        if state is not None:
            self._finish_stats(state, FinishReason.ABORT)
            self._count_in_flight()

    def fail_all(self, message: str, detail: str = "") -> None:
        """Every live request ends with EngineUnavailable(message, detail)."""
        for state in self.states.values():
            state.queue.put_nowait(EngineUnavailable(message, detail))
            self._finish_stats(state, FinishReason.ERROR)
        self.states.clear()
        self._count_in_flight()

    def resubmissions(self) -> list[tuple[int, EngineRequest]]:
        """Every live request as it is resubmitted to a restarted engine core: its prompt and
        the outputs it has so far (the engine continues after them; detokenizer, stop-string
        and usage state stay here)."""
        resubmitted = []
        for handle, state in self.states.items():
            if state.request is not None:
                outputs = list(state.detokenizer.token_ids)
                request = dataclasses.replace(
                    state.request, output_token_ids=outputs, is_resumed=True
                )
                resubmitted.append((handle, request))
        return resubmitted

    def _finish_stats(self, state: RequestState, reason: FinishReason) -> None:
        if not state.is_finished:
            state.is_finished = True
            self.metrics.on_finish(state.stats, reason)
            if state.span is not None and self.tracer is not None:
                self.tracer.finish(state, reason)

    def _count_in_flight(self) -> None:
        self.metrics.in_flight.set(len(self.states))

    def process_outputs(self, outputs: CoreOutputs) -> list[int]:
        """Apply one step's outputs; return handles finished here that the core still runs."""
        to_abort: list[int] = []
        details = outputs.details
        offset = 0
        for handle, count in zip(outputs.handles, outputs.num_new_tokens, strict=True):
            token_ids = outputs.new_token_ids[offset : offset + count]
            offset += count
            state = self.states.get(handle)
            if state is None:
                continue
            detail = details.pop(handle, None)
            if self._update(state, token_ids, detail, outputs.timestamp):
                to_abort.append(handle)
        for handle, detail in details.items():  # details without new tokens (e.g. an abort)
            state = self.states.get(handle)
            if state is not None and self._update(state, [], detail, outputs.timestamp):
                to_abort.append(handle)
        self._count_in_flight()
        return to_abort

    def _update(
        self,
        state: RequestState,
        token_ids: list[int],
        detail: CoreOutputDetail | None,
        core_ts: float,
    ) -> bool:
        """Update one request; True when a stop string finished it (the core must abort it)."""
        state.num_output_tokens += len(token_ids)
        if state.span is not None and state.first_output_at is None and token_ids:
            state.first_output_at = time.monotonic()
        finish = detail.finish_reason if detail else FinishReason.UNSPECIFIED
        if detail is not None and detail.num_cached_tokens is not None:
            state.num_cached_tokens = detail.num_cached_tokens
            state.stats.num_cached_tokens = detail.num_cached_tokens
        self.metrics.on_output(
            state.stats, len(token_ids), core_ts, detail.events if detail else None
        )
        stop_str = self._detokenize(state, token_ids, detail, finish)
        if stop_str is not None:
            finish = FinishReason.STOP
        delta = self._make_delta(state, token_ids, detail, finish, stop_str)
        if delta is not None:
            state.queue.put_nowait(delta)
        if finish == FinishReason.UNSPECIFIED and state.queue.qsize() > MAX_UNREAD_DELTAS:
            state.queue.put_nowait(
                Overloaded(f"the client read none of its last {MAX_UNREAD_DELTAS} updates; "
                           "the request was stopped (read the stream as it arrives)")
            )  # fmt: skip
            self._finish_stats(state, FinishReason.ABORT)
            self.states.pop(state.handle, None)
            return True  # abort it in the core: nobody reads it
        if finish != FinishReason.UNSPECIFIED:
            self._finish_stats(state, finish)
            state.is_finished = True
            self.states.pop(state.handle, None)
        return stop_str is not None and (detail is None or not detail.finish_reason)

    def _detokenize(
        self,
        state: RequestState,
        token_ids: list[int],
        detail: CoreOutputDetail | None,
        finish: FinishReason,
    ) -> str | None:
        """Extend state.text; return the stop string that matched, if any."""
        params = state.params
        text_ids = token_ids
        is_stop_token = finish == FinishReason.STOP and not params.include_stop_str_in_output
        if is_stop_token and token_ids and not _grammar_ended(state, token_ids[-1]):
            text_ids = token_ids[:-1]  # a stop token's own text is not part of the output
        new_text = state.detokenizer.step(text_ids) if text_ids else ""
        if finish != FinishReason.UNSPECIFIED:
            new_text += state.detokenizer.flush()
        state.text += new_text
        if not params.stop or not new_text or state.num_output_tokens <= params.min_tokens:
            return None
        found = find_stop_string(
            state.text, len(new_text), params.stop, params.include_stop_str_in_output
        )
        if found is None:
            return None
        matched, keep = found
        state.text = state.text[:keep]
        return matched

    def _make_delta(
        self,
        state: RequestState,
        token_ids: list[int],
        detail: CoreOutputDetail | None,
        finish: FinishReason,
        stop_str: str | None,
    ) -> CompletionDelta | None:
        is_finished = finish != FinishReason.UNSPECIFIED
        end = len(state.text) if is_finished else len(state.text) - stop_buffer_length(state.params)
        text = state.text[state.num_sent_chars : end] if end > state.num_sent_chars else ""
        state.num_sent_chars += len(text)
        logprobs = self._logprobs(detail.new_logprobs) if detail and detail.new_logprobs else []
        prompt_logprobs = (
            self._logprobs(detail.prompt_logprobs) if detail and detail.prompt_logprobs else []
        )
        if not (token_ids or text or is_finished or prompt_logprobs):
            return None
        return CompletionDelta(
            index=state.index,
            token_ids=token_ids,
            text=text,
            prompt_tokens=state.num_prompt_tokens,
            completion_tokens=state.num_output_tokens,
            cached_tokens=state.num_cached_tokens,
            finish_reason=finish,
            stop_token_id=detail.stop_token_id if detail and stop_str is None else None,
            stop_str=stop_str,
            error_message=detail.error_message if detail else "",
            error_kind=detail.error_kind if detail else ErrorKind.UNSPECIFIED,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            pooling_output=detail.pooling_output if detail else b"",
            kv_transfer_params_json=detail.kv_transfer_params_json if detail else "",
        )

    def _logprobs(self, table: LogprobsTable) -> list[TokenLogprobs]:
        """Columnar table -> per-position entries with each token's own text."""
        width = table.num_top_logprobs + 1
        decode = self.decoder.decode
        rows: list[TokenLogprobs] = []
        for pos in range(len(table.ranks)):
            base = pos * width
            entries = [
                Logprob(
                    table.token_ids[base + col],
                    table.logprobs[base + col],
                    col,
                    decode([table.token_ids[base + col]], False),
                )
                for col in range(width)
            ]
            entries[0].rank = table.ranks[pos]
            rows.append(TokenLogprobs(chosen=entries[0], top=entries[1:]))
        return rows

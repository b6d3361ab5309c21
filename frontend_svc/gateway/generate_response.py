"""The gateway contract's Generate replies: an engine's completion deltas -> smg-grpc-proto's
GenerateResponse messages (chunks and a Complete per completion index), as vLLM's servicer
answers."""

from __future__ import annotations

from smg_grpc_proto import vllm_engine_pb2 as pb

from frontend_svc.requests import CompletionDelta, TokenLogprobs
from splitserve_contracts.output_types import FinishReason
from splitserve_contracts.sampling_types import SamplingParams

FINISH_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.ERROR: "error",
}


def _output_logprobs(rows: list[TokenLogprobs], with_top: bool) -> pb.OutputLogProbs | None:
    if not rows:
        return None
    msg = pb.OutputLogProbs()
    for row in rows:
        msg.token_ids.append(row.chosen.token_id)
        msg.token_logprobs.append(row.chosen.logprob)
        if with_top:
            msg.top_logprobs.add(
                values=[t.logprob for t in row.top], token_ids=[t.token_id for t in row.top]
            )
    return msg


def _input_logprobs(
    rows: list[TokenLogprobs], prompt_token_ids: list[int], with_top: bool
) -> pb.InputLogProbs | None:
    """Prompt logprobs; the first prompt token has none (vLLM's shape)."""
    if not rows:
        return None
    msg = pb.InputLogProbs(token_ids=prompt_token_ids)
    msg.token_logprobs.add()
    if with_top:
        msg.top_logprobs.add()
    for row in rows:
        msg.token_logprobs.add(value=row.chosen.logprob)
        if with_top:
            msg.top_logprobs.add(
                values=[t.logprob for t in row.top], token_ids=[t.token_id for t in row.top]
            )
    return msg


class ResponseBuilder:
    """Deltas of one Generate call -> GenerateResponse messages: per completion index, chunks
    as tokens arrive and a Complete at the end (streamed), or one Complete holding every token
    (not streamed), as vLLM's servicer answers."""

    def __init__(self, params: SamplingParams, prompt_token_ids: list[int], stream: bool) -> None:
        self.stream = stream
        self.prompt_token_ids = prompt_token_ids
        self.with_top = bool(params.logprobs)
        self.with_prompt_top = bool(params.prompt_logprobs)
        self._tokens: dict[int, list[int]] = {}
        self._logprobs: dict[int, list[TokenLogprobs]] = {}
        self._prompt_logprobs: dict[int, list[TokenLogprobs]] = {}
        self._sent_prompt: set[int] = set()

    def responses(self, delta: CompletionDelta) -> list[pb.GenerateResponse]:
        index = delta.index
        tokens = self._tokens.setdefault(index, [])
        tokens.extend(delta.token_ids)
        self._logprobs.setdefault(index, []).extend(delta.logprobs)
        self._prompt_logprobs.setdefault(index, []).extend(delta.prompt_logprobs)
        out = []
        if self.stream and (delta.token_ids or delta.prompt_logprobs):
            out.append(pb.GenerateResponse(chunk=self._chunk(delta)))
        if delta.is_finished:
            out.append(pb.GenerateResponse(complete=self._complete(delta)))
        return out

    def _prompt_rows(self, index: int) -> pb.InputLogProbs | None:
        if index in self._sent_prompt:
            return None
        rows = self._prompt_logprobs.get(index, [])
        if rows:
            self._sent_prompt.add(index)
        return _input_logprobs(rows, self.prompt_token_ids, self.with_prompt_top)

    def _chunk(self, delta: CompletionDelta) -> pb.GenerateStreamChunk:
        return pb.GenerateStreamChunk(
            token_ids=delta.token_ids,
            prompt_tokens=delta.prompt_tokens,
            completion_tokens=len(delta.token_ids),
            cached_tokens=delta.cached_tokens,
            output_logprobs=_output_logprobs(delta.logprobs, self.with_top),
            input_logprobs=self._prompt_rows(delta.index),
            index=delta.index,
        )

    def _complete(self, delta: CompletionDelta) -> pb.GenerateComplete:
        index = delta.index
        tokens = delta.token_ids if self.stream else self._tokens[index]
        logprobs = delta.logprobs if self.stream else self._logprobs[index]
        msg = pb.GenerateComplete(
            output_ids=tokens,
            finish_reason=FINISH_REASONS[delta.finish_reason],
            prompt_tokens=delta.prompt_tokens,
            completion_tokens=delta.completion_tokens,
            cached_tokens=delta.cached_tokens,
            output_logprobs=_output_logprobs(logprobs, self.with_top),
            input_logprobs=self._prompt_rows(index),
            index=index,
        )
        if delta.kv_transfer_params_json:
            msg.kv_transfer_params_json = delta.kv_transfer_params_json  # the producer's handoff
        if delta.stop_str is not None:
            msg.matched_stop_str = delta.stop_str
        elif delta.stop_token_id is not None:
            msg.matched_token_id = delta.stop_token_id
        return msg

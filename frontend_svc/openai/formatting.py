"""OpenAI response pieces built from the frontend's deltas: choices' state, usage, logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from frontend_svc.kv_transfer import params_from_json
from frontend_svc.requests import CompletionDelta, Logprob, TokenLogprobs
from splitserve_contracts.output_types import FinishReason

MIN_LOGPROB = -9999.0
"""-inf is not JSON; OpenAI (and vLLM) send this instead."""


@dataclass(slots=True)
class ChoiceState:
    """One choice (prompt x completion index) as its deltas arrive."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """A KV producer's handoff (vLLM's response field `kv_transfer_params`), with the finish."""

    def add(self, delta: CompletionDelta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.prompt_logprobs += delta.prompt_logprobs
        self.num_prompt_tokens = delta.prompt_tokens
        self.num_cached_tokens = delta.cached_tokens
        if delta.is_finished:
            self.finish_reason = finish_reason(delta.finish_reason)
            self.stop_reason = stop_reason(delta)
            self.kv_transfer_params = params_from_json(delta.kv_transfer_params_json)


def envelope(
    rid: str, kind: str, created: int, model: str, choices: list[Any], usage: Any = None
) -> dict[str, Any]:
    """A response or chunk: id, object, created, model, choices (and usage when given)."""
    body = {"id": rid, "object": kind, "created": created, "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


def finish_reason(reason: FinishReason) -> str | None:
    return None if reason == FinishReason.UNSPECIFIED else str(reason)


def stop_reason(delta: CompletionDelta) -> str | int | None:
    """vLLM's `stop_reason`: the stop string or stop token id; None for EOS and length."""
    return delta.stop_str if delta.stop_str is not None else delta.stop_token_id


def usage(num_prompt: int, num_completion: int, num_cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def _top_dict(row: TokenLogprobs) -> dict[str, float]:
    """Completions' top_logprobs entry: the chosen token and the top alternatives (vLLM)."""
    out = {row.chosen.decoded_token: _logprob(row.chosen.logprob)}
    for entry in row.top:
        out.setdefault(entry.decoded_token, _logprob(entry.logprob))
    return out


def completion_logprobs(
    rows: list[TokenLogprobs | Logprob], text_offset: int = 0
) -> tuple[dict[str, Any], int]:
    """The legacy completions `logprobs` object and the text offset after it. A bare Logprob
    row is a position without a log-probability (the first prompt token when echoing)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for row in rows:
        chosen = row if isinstance(row, Logprob) else row.chosen
        tokens.append(chosen.decoded_token)
        offsets.append(text_offset)
        text_offset += len(chosen.decoded_token)
        if isinstance(row, Logprob):
            token_logprobs.append(None)
            top.append(None)
        else:
            token_logprobs.append(_logprob(row.chosen.logprob))
            top.append(_top_dict(row))
    body = {
        "text_offset": offsets,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": top,
    }
    return body, text_offset


def _chat_entry(entry: Logprob) -> dict[str, Any]:
    token = entry.decoded_token
    return {"token": token, "logprob": _logprob(entry.logprob), "bytes": list(token.encode())}


def chat_logprobs(rows: list[TokenLogprobs]) -> dict[str, Any]:
    """Chat's `logprobs`: one entry per token with its top alternatives."""
    return {
        "content": [
            {**_chat_entry(row.chosen), "top_logprobs": [_chat_entry(e) for e in row.top]}
            for row in rows
        ]
    }


def prompt_logprobs(rows: list[TokenLogprobs]) -> list[Any]:
    """vLLM's `prompt_logprobs`: per prompt position a {token_id: {logprob, rank,
    decoded_token}} map (chosen token and alternatives), None for the first position."""
    out: list[Any] = [None]
    for row in rows:
        entries: dict[str, dict[str, object]] = {}
        for entry in (row.chosen, *row.top):
            entries.setdefault(
                str(entry.token_id),
                {
                    "logprob": _logprob(entry.logprob),
                    "rank": entry.rank,
                    "decoded_token": entry.decoded_token,
                },
            )
        out.append(entries)
    return out

"""InputProcessor: tokenize prompts, render chats, validate everything before the engine sees it."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from frontend_svc.requests import (
    ChatTurn,
    EngineRequest,
    GenerateInput,
    InvalidRequest,
    PromptInput,
)
from splitserve_contracts import sampling_rules
from splitserve_contracts.sampling_rules import InvalidSamplingParams, Limits
from splitserve_runtime.model_source import GGUF_SUFFIX

logger = logging.getLogger(__name__)


def load_tokenizer(path: str) -> Any:
    """The HF (fast) tokenizer of a local checkpoint folder or .gguf file; never touches the
    network."""
    if path.endswith(GGUF_SUFFIX):
        from splitserve_runtime.gguf_checkpoint import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


@dataclass(frozen=True, slots=True)
class TokenizedPrompt:
    token_ids: list[int]
    text: str | None


class InputProcessor:
    """Turns a public Generate call into an EngineRequest, or raises InvalidRequest.

    `sampling_defaults` (SamplingParams field -> value, from the generation config) fill the
    fields a request leaves unset, when its protobuf is converted."""

    def __init__(
        self,
        tokenizer: Any,
        max_model_len: int,
        limits: Limits,
        extra_eos_ids: tuple[int, ...] = (),
        sampling_defaults: Mapping[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.limits = limits
        self.sampling_defaults = dict(sampling_defaults or {})
        self.eos_token_id: int | None = tokenizer.eos_token_id
        self.extra_eos_ids = tuple(i for i in extra_eos_ids if i != self.eos_token_id)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def tokenize(self, prompt: PromptInput) -> TokenizedPrompt:
        """Token ids of a prompt, as Generate would send them to the engine."""
        if prompt.token_ids is not None:
            return TokenizedPrompt(list(prompt.token_ids), None)
        if prompt.chat is not None:
            text = self.render_chat(prompt.chat, prompt.add_generation_prompt)
            # The template already holds the special tokens it wants (vLLM does the same).
            return TokenizedPrompt(self._encode(text, add_special_tokens=False), text)
        text = prompt.text or ""
        return TokenizedPrompt(self._encode(text, prompt.add_special_tokens), text)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(self, chat: tuple[ChatTurn, ...], add_generation_prompt: bool) -> str:
        if not chat:
            raise InvalidRequest("chat has no messages; send at least one message")
        if not self.has_chat_template:
            raise InvalidRequest("this model has no chat template; send `prompt` text instead")
        messages = [{"role": t.role, "content": t.content} for t in chat]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # jinja errors: a template that rejects these roles, etc.
            raise InvalidRequest(f"the chat template cannot render these messages: {exc}") from exc
        return str(text)

    def process(self, call: GenerateInput) -> EngineRequest:
        """Validate and tokenize; resolve max_tokens, EOS and the stop token ids."""
        _check_prompt_present(call.prompt)
        try:
            sampling_rules.validate(call.params, self.limits)
        except InvalidSamplingParams as err:
            raise InvalidRequest(str(err)) from None
        params = sampling_rules.normalize(call.params)
        prompt = self.tokenize(call.prompt)
        num_prompt = len(prompt.token_ids)
        max_len = self.max_model_len
        if num_prompt == 0:
            raise InvalidRequest("the prompt tokenizes to no tokens; send a non-empty prompt")
        if call.prompt.token_ids is not None:
            _check_prompt_ids(prompt.token_ids, self.limits.vocab_size)
        if num_prompt >= max_len:
            raise InvalidRequest(
                f"the prompt has {num_prompt} tokens but max_model_len is "
                f"{max_len}; shorten it to at most {max_len - 1} tokens"
            )
        max_tokens = params.max_tokens or max_len - num_prompt
        if num_prompt + max_tokens > max_len:
            raise InvalidRequest(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds max_model_len "
                f"({max_len}); set max_tokens to at most {max_len - num_prompt}"
            )
        stop_ids = params.stop_token_ids
        if not params.ignore_eos:
            stop_ids = tuple(dict.fromkeys(stop_ids + self.extra_eos_ids))
        params = dataclasses.replace(params, max_tokens=max_tokens, stop_token_ids=stop_ids)
        eos_token_id = None if params.ignore_eos else self.eos_token_id
        return EngineRequest(
            call.request_id,
            prompt.token_ids,
            params,
            eos_token_id,
            call.priority,
            call.cache_salt,
        )


def _check_prompt_present(prompt: PromptInput) -> None:
    if prompt.token_ids is not None and not prompt.token_ids:
        raise InvalidRequest("prompt_token_ids is empty; send at least one token id")
    if prompt.text is not None and not prompt.text:
        raise InvalidRequest("prompt is empty; send non-empty text, prompt_token_ids or chat")
    if prompt.text is None and prompt.token_ids is None and prompt.chat is None:
        raise InvalidRequest("no prompt given; set one of prompt, prompt_token_ids or chat")


def _check_prompt_ids(ids: list[int], vocab_size: int) -> None:
    for i, token_id in enumerate(ids):
        if token_id >= vocab_size:
            raise InvalidRequest(
                f"prompt_token_ids[{i}] = {token_id} is outside the vocabulary "
                f"(valid ids: 0..{vocab_size - 1})"
            )

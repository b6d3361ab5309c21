"""InputProcessor: tokenize prompts, render chats, validate everything before the engine sees it."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from frontend_svc.errors import InvalidRequest
from frontend_svc.inputs.multimodal import (
    MultiModalProcessor,
    ProcessedImage,
    chat_messages,
    template_uses_content_parts,
)
from frontend_svc.requests import (
    MAX_REQUEST_ID_CHARS,
    EngineRequest,
    GenerateInput,
    MultiModalFeature,
    PromptInput,
)
from splitserve_contracts import sampling_rules, structured_outputs
from splitserve_contracts.sampling_rules import InvalidSamplingParams, Limits
from splitserve_contracts.structured_outputs import (
    InvalidStructuredOutputs,
    StructuredOutputsParams,
)
from splitserve_runtime.grammars import check_grammar
from splitserve_runtime.model_spec import GGUF_SUFFIX

logger = logging.getLogger(__name__)
T = TypeVar("T")


def load_tokenizer(path: str) -> Any:
    """The HF (fast) tokenizer of a local checkpoint folder or .gguf file; never touches the
    network."""
    if path.endswith(GGUF_SUFFIX):
        from splitserve_runtime.gguf_checkpoint import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def max_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the UTF-8 bytes of text one token decodes to (vocabulary strings
    over-count byte-level and SentencePiece markers, which keeps the bound safe)."""
    vocab = tokenizer.get_vocab()
    return max((len(token.encode()) for token in vocab), default=1) or 1


RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tokenize",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tools",
        "documents",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "padding",
        "truncation",
        "max_length",
    }
)
"""apply_chat_template's own parameters: chat_template_kwargs may not set them (vLLM's
CVE-2025-62426: `tokenize=True` from a request)."""


@dataclass(frozen=True, slots=True)
class TokenizedPrompt:
    token_ids: list[int]
    text: str | None
    mm_features: tuple[MultiModalFeature, ...] = ()


class InputProcessor:
    """Turns a public Generate call into an EngineRequest, or raises InvalidRequest.

    `sampling_defaults` (SamplingParams field -> value, from the generation config) fill the
    fields a request leaves unset, when its protobuf is converted. `multimodal` processes the
    images of chat messages (None: a text-only model, which refuses them)."""

    def __init__(
        self,
        tokenizer: Any,
        max_model_len: int,
        limits: Limits,
        extra_eos_ids: tuple[int, ...] = (),
        sampling_defaults: Mapping[str, Any] | None = None,
        tokenizer_threads: int = 4,
        multimodal: MultiModalProcessor | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.multimodal = multimodal
        self.max_model_len = max_model_len
        self.limits = limits
        self.sampling_defaults = dict(sampling_defaults or {})
        self.eos_token_id: int | None = tokenizer.eos_token_id
        self.extra_eos_ids = tuple(i for i in extra_eos_ids if i != self.eos_token_id)
        self._pool = ThreadPoolExecutor(max_workers=tokenizer_threads, thread_name_prefix="tok")
        self.max_prompt_bytes = max_model_len * max_token_bytes(tokenizer)
        """Text longer than this cannot fit max_model_len whatever it says (no token stands
        for more bytes), so it is refused before the tokenizer spends time on it."""

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run tokenizer work (process, tokenize, decode) on the tokenizer threads, off the
        event loop: a large prompt must not stall every other stream."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def tokenize(self, prompt: PromptInput) -> TokenizedPrompt:
        """Token ids of a prompt, as Generate would send them to the engine."""
        if prompt.token_ids is not None:
            token_ids = list(prompt.token_ids)
            if self.multimodal is not None:  # image tokens need images: refuse them here
                self.multimodal.expand(token_ids, [])
            return TokenizedPrompt(token_ids, None)
        self._check_size(prompt)
        images: list[ProcessedImage] = []
        if prompt.chat is not None:
            text = self.render_chat(prompt)
            images = self._process_images(prompt)
            # The template already holds the special tokens it wants (vLLM does the same).
            token_ids = self._encode(text, add_special_tokens=False)
        else:
            text = prompt.text or ""
            token_ids = self._encode(text, prompt.add_special_tokens)
        if self.multimodal is None:
            return TokenizedPrompt(token_ids, text)
        token_ids, features = self.multimodal.expand(token_ids, images)
        return TokenizedPrompt(token_ids, text, features)

    def _process_images(self, prompt: PromptInput) -> list[ProcessedImage]:
        images = [image for turn in prompt.chat or () for image in turn.images]
        if not images:
            return []
        if self.multimodal is None:
            raise InvalidRequest(
                f"{images[0].where}: this model takes text only; send the message without "
                "images, or serve a multimodal model (e.g. LLaVA)",
                images[0].where,
            )
        return self.multimodal.process_images(images)

    def _check_size(self, prompt: PromptInput) -> None:
        texts = [t.text for t in prompt.chat] if prompt.chat is not None else [prompt.text or ""]
        num_bytes = sum(len(text.encode(errors="replace")) for text in texts)
        if num_bytes > self.max_prompt_bytes:
            raise InvalidRequest(
                f"the prompt has {num_bytes} bytes of text, more than any prompt that fits "
                f"max_model_len {self.max_model_len} ({self.max_prompt_bytes} bytes); shorten it",
                "chat" if prompt.chat is not None else "prompt",
            )

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(self, prompt: PromptInput) -> str:
        """The prompt's chat rendered with the model's chat template."""
        chat = prompt.chat
        if not chat:
            raise InvalidRequest("chat has no messages; send at least one message", "chat")
        if not self.has_chat_template:
            raise InvalidRequest(
                "this model has no chat template; send `prompt` text instead", "chat"
            )
        for i, turn in enumerate(chat):
            if turn.parts and turn.content:
                raise InvalidRequest(
                    f"chat.messages[{i}] sets both content and content_parts; send one of them",
                    f"chat.messages[{i}]",
                )
        if prompt.continue_final_message and prompt.add_generation_prompt:
            raise InvalidRequest(
                "continue_final_message and add_generation_prompt cannot both be true; "
                "set add_generation_prompt to false to continue the last message",
                "continue_final_message",
            )
        extra = _template_kwargs(prompt)
        mm = self.multimodal
        messages = chat_messages(
            chat,
            mm.spec.image_token if mm is not None else None,
            mm is not None and template_uses_content_parts(str(self.tokenizer.chat_template)),
        )
        for message, turn in zip(messages, chat, strict=True):
            message.update(turn.template_fields())
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=prompt.add_generation_prompt,
                continue_final_message=prompt.continue_final_message,
                **extra,
            )
        except Exception as exc:  # jinja errors: a template that rejects these roles, etc.
            raise InvalidRequest(
                f"the chat template cannot render these messages: {exc}", "chat.messages"
            ) from exc
        return str(text)

    def _prompt_ends_reasoning(self, call: GenerateInput, prompt: TokenizedPrompt) -> bool:
        """Whether the prompt closed the model's thinking. For a chat with a generation
        prompt only that cue counts (Qwen3's with enable_thinking false holds
        `<think></think>`): earlier assistant turns' thinking is history. Otherwise the last
        think token of the prompt decides (vLLM's is_reasoning_end)."""
        tokens = call.reasoning
        assert tokens is not None
        chat = call.prompt
        if chat.chat is None or not chat.add_generation_prompt or prompt.text is None:
            return tokens.ended_in(prompt.token_ids)
        history = self.render_chat(dataclasses.replace(chat, add_generation_prompt=False))
        cue = prompt.text[len(history) :] if prompt.text.startswith(history) else prompt.text
        return tokens.ended_in_text(cue)

    def check_num_token_ids(self, num_ids: int, field: str) -> None:
        """Ids to detokenize: at most max_model_len (both APIs)."""
        if num_ids > self.max_model_len:
            raise InvalidRequest(
                f"{num_ids} token ids; at most max_model_len ({self.max_model_len})", field
            )

    def check_token_ids(self, ids: Sequence[int], field: str) -> None:
        """Ids to detokenize: at most max_model_len, each in the vocabulary (both APIs)."""
        self.check_num_token_ids(len(ids), field)
        vocab_size = self.limits.vocab_size
        bad = next((i for i, token_id in enumerate(ids) if not 0 <= token_id < vocab_size), None)
        if bad is not None:
            raise InvalidRequest(
                f"{field}[{bad}] = {ids[bad]} is outside the vocabulary (valid ids: "
                f"0..{vocab_size - 1})",
                field,
            )

    def process(self, call: GenerateInput) -> EngineRequest:
        """Validate and tokenize; resolve max_tokens, EOS and the stop token ids."""
        _check_prompt_present(call.prompt)
        _check_ids(call)
        try:
            sampling_rules.validate(call.params, self.limits)
        except InvalidSamplingParams as err:
            field = f"sampling_params.{err.field}" if err.field else "sampling_params"
            raise InvalidRequest(str(err), field) from None
        params = sampling_rules.normalize(call.params)
        params = sampling_rules.clamp_top_k(params, self.limits.vocab_size)
        if call.structured_outputs is not None:
            if not hasattr(self.tokenizer, "backend_tokenizer"):
                raise InvalidRequest(
                    "structured outputs need a fast (Hugging Face tokenizers) tokenizer; this "
                    "model's tokenizer is not one",
                    call.structured_outputs_field,
                )
            _check_structured_outputs(call.structured_outputs, call.structured_outputs_field)
        prompt = self.tokenize(call.prompt)
        num_prompt = len(prompt.token_ids)
        max_len, field = self.max_model_len, _prompt_field(call.prompt)
        if num_prompt == 0:
            raise InvalidRequest(
                "the prompt tokenizes to no tokens; send a non-empty prompt", field
            )
        if call.prompt.token_ids is not None:
            _check_prompt_ids(prompt.token_ids, self.limits.vocab_size)
        if num_prompt >= max_len:
            raise InvalidRequest(
                f"the prompt has {num_prompt} tokens but max_model_len is "
                f"{max_len}; shorten it to at most {max_len - 1} tokens",
                field,
            )
        max_tokens = params.max_tokens or max_len - num_prompt
        if num_prompt + max_tokens > max_len:
            raise InvalidRequest(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds max_model_len "
                f"({max_len}); set max_tokens to at most {max_len - num_prompt}",
                "sampling_params.max_tokens",
            )
        if params.min_tokens > max_tokens:
            raise InvalidRequest(
                f"min_tokens ({params.min_tokens}) exceeds the {max_tokens} tokens this request "
                f"can generate (max_tokens, or what max_model_len leaves); lower min_tokens",
                "sampling_params.min_tokens",
            )
        stop_ids = params.stop_token_ids
        if not params.ignore_eos:
            stop_ids = tuple(dict.fromkeys(stop_ids + self.extra_eos_ids))
        params = dataclasses.replace(params, max_tokens=max_tokens, stop_token_ids=stop_ids)
        eos_token_id = None if params.ignore_eos else self.eos_token_id
        is_ended = call.reasoning is not None and self._prompt_ends_reasoning(call, prompt)
        return EngineRequest(
            call.request_id,
            prompt.token_ids,
            params,
            eos_token_id,
            call.priority,
            call.cache_salt,
            prompt.mm_features,
            structured_outputs=call.structured_outputs,
            lora_name=call.lora_name,
            reasoning_end_token_id=None if is_ended else _reasoning_end(call),
            prompt_ends_reasoning=is_ended,
            kv_transfer_params_json=call.kv_transfer_params_json,
        )


MAX_CACHE_SALT_CHARS = 256


def _template_kwargs(prompt: PromptInput) -> dict[str, Any]:
    """apply_chat_template's extra arguments: the request's chat_template_kwargs (which may not
    set its own parameters) and the tools."""
    extra = dict(prompt.chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(extra))
    if reserved:
        raise InvalidRequest(
            f"chat_template_kwargs may not set {', '.join(reserved)}; use the request's own fields",
            "chat_template_kwargs",
        )
    if prompt.tools:
        extra["tools"] = list(prompt.tools)
    return extra


def _reasoning_end(call: GenerateInput) -> int | None:
    """The token after which a thinking model's grammar starts (None: at once)."""
    if call.structured_outputs is None or call.reasoning is None:
        return None
    return call.reasoning.end_id


def _check_structured_outputs(params: StructuredOutputsParams, where: str) -> None:
    """Refuse a constraint the engine could not compile, naming the request's field."""
    try:
        structured_outputs.validate(params)
        check_grammar(params)
    except InvalidStructuredOutputs as err:
        if where == "structured_outputs":
            message = err.describe()
            raise InvalidRequest(message, message.split(":", 1)[0]) from None
        raise InvalidRequest(f"{where}: {err}", where) from None


def _check_ids(call: GenerateInput) -> None:
    if len(call.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(
            f"request_id has {len(call.request_id)} characters; at most {MAX_REQUEST_ID_CHARS}",
            "request_id",
        )
    if len(call.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequest(
            f"cache_salt has {len(call.cache_salt)} characters; at most {MAX_CACHE_SALT_CHARS}",
            "cache_salt",
        )


def _prompt_field(prompt: PromptInput) -> str:
    if prompt.chat is not None:
        return "chat"
    return "prompt_token_ids" if prompt.token_ids is not None else "prompt"


def _check_prompt_present(prompt: PromptInput) -> None:
    if prompt.token_ids is not None and not prompt.token_ids:
        raise InvalidRequest(
            "prompt_token_ids is empty; send at least one token id", "prompt_token_ids"
        )
    if prompt.text is not None and not prompt.text:
        raise InvalidRequest(
            "prompt is empty; send non-empty text, prompt_token_ids or chat", "prompt"
        )
    if prompt.text is None and prompt.token_ids is None and prompt.chat is None:
        raise InvalidRequest(
            "no prompt given; set one of prompt, prompt_token_ids or chat", "prompt"
        )


def _check_prompt_ids(ids: list[int], vocab_size: int) -> None:
    for i, token_id in enumerate(ids):
        if not 0 <= token_id < vocab_size:
            raise InvalidRequest(
                f"prompt_token_ids[{i}] = {token_id} is outside the vocabulary "
                f"(valid ids: 0..{vocab_size - 1})",
                "prompt_token_ids",
            )

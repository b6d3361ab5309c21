"""Structured outputs in the engine core (vLLM's StructuredOutputManager, `guidance` backend).

    frontend stream --TokenizerInfo--> set_tokenizer (built on the compile pool, by content)
    request with a constraint --> submit: compiled on the compile pool, off the busy loop; the
        request waits outside the scheduler (vLLM's WAITING_FOR_FSM) without blocking others
    take_compiled (each loop iteration) --> ready requests go to the scheduler; a bad grammar,
        or one past the compile time limit, fails its request (INVALID_REQUEST)
    each step --> fill_bitmask: one packed int32 row per constrained request that samples,
        filled by llguidance (in parallel, LLExecutor, for large batches), shipped with the step
    each applied token --> StructuredOutputRequest.accept advances the request's matcher; a
        complete grammar finishes the request (STOP); a matcher that failed (one of llguidance's
        limits) fails it (INVALID_REQUEST), never passing for a complete grammar

Masks are the model's width whichever of model and tokenizer has more ids: the tokenizer is
llguidance's with max(the two) ids, and a wider tokenizer's rows are cut to the model's
(core_svc/structured_output/grammar_masks.py).

The matcher only ever consumes tokens the engine applied (never a placeholder of a step in
flight, never an unverified draft: a speculating request's per-draft masks come from
llguidance's fill with draft tokens, which rolls them back), so it always matches
`output_token_ids`: async steps need no rollback, a preempted or
recovered request keeps its matcher, and a request resubmitted after a core restart rebuilds it
by consuming the tokens it brings. llguidance, not xgrammar: the core never imports torch, and
xgrammar imports it on import.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
from tokenizers import Tokenizer

from core_svc.structured_output.grammar_masks import GrammarMasks
from core_svc.structured_output.grammar_state import CompiledGrammar, StructuredOutputRequest
from splitserve_contracts.structured_outputs import (
    InvalidStructuredOutputs,
    StructuredOutputsParams,
)
from splitserve_runtime.grammar_stack import GrammarThreadPool
from splitserve_runtime.grammars import parser_limits, summary, to_llguidance

logger = logging.getLogger(__name__)

MAX_TOKENIZER_JSON_CHARS = 64 * 1024 * 1024
MAX_TOKENIZERS = 8
"""Distinct tokenizers kept at once (frontends normally share one)."""


@dataclass(frozen=True, slots=True)
class StructuredOutputsConfig:
    """How the core compiles grammars (vLLM's StructuredOutputsConfig, backend `guidance`)."""

    compile_timeout_s: float = 10.0
    """A grammar still compiling after this long fails its request (a schema too costly)."""
    num_compile_threads: int = 2
    """Threads compiling grammars (and building tokenizers), off the busy loop."""
    num_fill_threads: int = 0
    """Threads of llguidance's parallel bitmask fill; 0: llguidance's default (80 % of the
    CPUs, at most 32)."""
    fill_parallel_threshold: int = 128
    """Steps with fewer constrained rows fill their masks on the busy loop, one after another
    (microseconds each); larger ones use the parallel fill (vLLM's
    fill_bitmask_parallel_threshold: thread hand-offs cost more than they save below it)."""
    max_cached_grammars: int = 512
    """Compiled grammars kept, by (tokenizer, constraint), least recently used dropped."""


DEFAULT_STRUCTURED_OUTPUTS = StructuredOutputsConfig()


@dataclass(slots=True)
class _Compiling:
    state: StructuredOutputRequest
    future: Future[llguidance.LLMatcher]
    deadline: float


class StructuredOutputManager:
    """Compiles grammars off the busy loop, caches them, fills step bitmasks; see the module
    docstring. Called from the busy-loop thread only (the compile pool is internal);
    `on_compiled` runs on a compile thread when a grammar is ready (wakes the loop)."""

    def __init__(
        self,
        vocab_size: int,
        config: StructuredOutputsConfig,
        on_compiled: Callable[[], None] = lambda: None,
    ) -> None:
        self.vocab_size = vocab_size
        self.config = config
        self.masks = GrammarMasks(
            vocab_size, config.fill_parallel_threshold, config.num_fill_threads
        )
        self._on_compiled = on_compiled
        self._pool: ThreadPoolExecutor | None = None
        self._tokenizers: OrderedDict[bytes, Future[llguidance.LLTokenizer]] = OrderedDict()
        self._client_tokenizers: dict[int, bytes] = {}
        self._compiled: OrderedDict[tuple[object, ...], CompiledGrammar] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._compiling: dict[int, _Compiling] = {}
        """req_handle -> its compile in progress."""
        self.num_compiled = 0
        self.num_cache_queries = 0
        """Grammar cache lookups, one per request that compiles (vLLM's
        structured_output_cache_queries); with num_cache_hits, cumulative."""
        self.num_cache_hits = 0

    def _compile_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:  # stacks the deepest grammar fits (a deeper one kills the core)
            self._pool = GrammarThreadPool(self.config.num_compile_threads, "grammar-compile")
        return self._pool

    # -- tokenizers ----------------------------------------------------------------------------

    def set_tokenizer(
        self, client_id: int, tokenizer_json: str, eos_token_ids: Sequence[int]
    ) -> None:
        """The client's tokenizer (untrusted: checked when built; a bad one fails the
        client's constrained requests with llguidance's reason)."""
        digest = hashlib.sha256(tokenizer_json.encode()).digest()
        digest += bytes(str(sorted(eos_token_ids)), "ascii")
        self._client_tokenizers[client_id] = digest
        if digest in self._tokenizers:
            self._tokenizers.move_to_end(digest)
            return
        eos = list(eos_token_ids)
        self._tokenizers[digest] = self._compile_pool().submit(
            self._build_tokenizer, tokenizer_json, eos
        )
        while len(self._tokenizers) > MAX_TOKENIZERS:
            self._tokenizers.popitem(last=False)

    def _build_tokenizer(self, tokenizer_json: str, eos: list[int]) -> llguidance.LLTokenizer:
        """llguidance's tokenizer of max(the model's vocabulary, the tokenizer's ids) (vLLM's
        `from_tokenizer(tokenizer, max(vocab_size, len(tokenizer)))`): llguidance pads a
        tokenizer to n_vocab but refuses one larger than it."""
        if len(tokenizer_json) > MAX_TOKENIZER_JSON_CHARS:
            raise InvalidStructuredOutputs("the frontend's tokenizer is too large", "tokenizer")
        try:  # its ids as llguidance counts them (tokenizers' get_vocab_size(true))
            num_ids = Tokenizer.from_str(tokenizer_json).get_vocab_size(with_added_tokens=True)
            tokenizer = llguidance.LLTokenizer(  # which checks the eos ids against them
                tokenizer_json, n_vocab=max(self.vocab_size, num_ids), eos_token=eos or None
            )
        except Exception as err:  # noqa: BLE001 (llguidance's parse errors are plain exceptions)
            raise InvalidStructuredOutputs(
                f"the frontend's tokenizer cannot be used for structured outputs: {err}",
                "tokenizer",
            ) from None
        logger.info("structured outputs: tokenizer of %d tokens ready", tokenizer.vocab_size)
        if tokenizer.vocab_size > self.vocab_size:
            logger.info("its ids past the model's %d are never allowed", self.vocab_size)
            self.masks.has_wider_tokenizer = True
        return tokenizer

    def forget_client(self, client_id: int) -> None:
        self._client_tokenizers.pop(client_id, None)

    # -- compiling -----------------------------------------------------------------------------

    def submit(
        self,
        req_handle: int,
        client_id: int,
        state: StructuredOutputRequest,
        output_token_ids: Sequence[int],
    ) -> str | None:
        """Start compiling a request's grammar; returns why it cannot be (no tokenizer)."""
        digest = self._client_tokenizers.get(client_id)
        tokenizer = None if digest is None else self._tokenizers.get(digest)
        if digest is None or tokenizer is None:
            return (
                "structured outputs need the frontend's tokenizer (TokenizerInfo) on the "
                "stream before the request"
            )
        future = self._compile_pool().submit(
            self._compile, tokenizer, digest, state, state.after_reasoning(output_token_ids)
        )
        deadline = time.monotonic() + self.config.compile_timeout_s
        self._compiling[req_handle] = _Compiling(state, future, deadline)
        future.add_done_callback(lambda _: self._on_compiled())
        return None

    def _compile(
        self,
        tokenizer_future: Future[llguidance.LLTokenizer],
        digest: bytes,
        state: StructuredOutputRequest,
        output_token_ids: list[int],
    ) -> llguidance.LLMatcher:
        tokenizer = tokenizer_future.result()
        key = (digest, *state.params.cache_key)
        with self._cache_lock:
            self.num_cache_queries += 1
            template = self._compiled.get(key)
            if template is not None and template.is_spent:
                template = None  # a copy failed: compiled anew (StructuredOutputRequest)
            if template is not None:
                self._compiled.move_to_end(key)
                self.num_cache_hits += 1
        if template is None:
            compiled = self._compile_grammar(tokenizer, state.params)
            template = CompiledGrammar(compiled, tokenizer.vocab_size)
            with self._cache_lock:
                self._compiled[key] = template
                while len(self._compiled) > self.config.max_cached_grammars:
                    self._compiled.popitem(last=False)
        state.template = template
        matcher = template.matcher.deep_copy()
        if output_token_ids and not matcher.consume_tokens(output_token_ids):
            raise InvalidStructuredOutputs(
                "the output tokens the request brings do not follow its grammar",
                state.params.kind,
            )
        return matcher

    def _compile_grammar(
        self, tokenizer: llguidance.LLTokenizer, params: StructuredOutputsParams
    ) -> llguidance.LLMatcher:
        started = time.perf_counter()
        grammar = to_llguidance(params)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
        if matcher.is_error():
            reason = summary([matcher.get_error()])
            raise InvalidStructuredOutputs(f"is not supported: {reason}", params.kind)
        self.num_compiled += 1
        logger.debug(
            "compiled a %s grammar in %.1f ms", params.kind, 1e3 * (time.perf_counter() - started)
        )
        return matcher

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def is_compiling(self, req_handle: int) -> bool:
        return req_handle in self._compiling

    def has_news(self, now: float) -> bool:
        """Some compile finished or is past its time limit."""
        return any(c.future.done() or now > c.deadline for c in self._compiling.values())

    def cancel(self, req_handle: int) -> None:
        """Forget a compile (its request was aborted); the pool finishes it unseen."""
        self._compiling.pop(req_handle, None)

    def take_compiled(self, now: float) -> tuple[list[int], list[tuple[int, str]]]:
        """Handles whose grammar is ready (their matcher set), and handles that failed with
        why: an invalid grammar, or one still compiling past the time limit."""
        ready: list[int] = []
        failed: list[tuple[int, str]] = []
        for handle, compiling in list(self._compiling.items()):
            future = compiling.future
            if not future.done():
                if now > compiling.deadline:
                    del self._compiling[handle]
                    limit = self.config.compile_timeout_s
                    failed.append((handle, f"the grammar took longer than {limit:g} s to compile"))
                continue
            del self._compiling[handle]
            error = future.exception()
            if error is None:
                compiling.state.matcher = future.result()
                ready.append(handle)
            elif isinstance(error, InvalidStructuredOutputs):
                failed.append((handle, error.describe()))
            else:
                logger.error("compiling a grammar failed: %r", error)
                failed.append((handle, f"the grammar could not be compiled: {error}"))
        return ready, failed

    # -- the step ------------------------------------------------------------------------------

    def fill_bitmask(
        self,
        states: Sequence[StructuredOutputRequest],
        drafts: Sequence[Sequence[int]] = (),
    ) -> bytes:
        """The packed masks of `states` (and of their drafts), one row each in order, at the
        model's width: core_svc/structured_output/grammar_masks.py."""
        return self.masks.fill(states, drafts)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

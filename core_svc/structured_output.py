"""Structured outputs in the engine core (vLLM's StructuredOutputManager, `guidance` backend).

    frontend stream --TokenizerInfo--> set_tokenizer (built on the compile pool, by content)
    request with a constraint --> submit: compiled on the compile pool, off the busy loop; the
        request waits outside the scheduler (vLLM's WAITING_FOR_FSM) without blocking others
    take_compiled (each loop iteration) --> ready requests go to the scheduler; a bad grammar,
        or one past the compile time limit, fails its request (INVALID_REQUEST)
    each step --> fill_bitmask: one packed int32 row per constrained request that samples,
        filled by llguidance (in parallel, LLExecutor, for large batches), shipped with the step
    each applied token --> StructuredOutputRequest.accept advances the request's matcher; a
        complete grammar finishes the request (STOP)

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
import numpy as np
from llguidance.numpy import (
    fill_next_token_bitmask_par,
    fill_next_token_bitmask_par_with_draft_tokens,
)

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


class StructuredOutputRequest:
    """One request's grammar state (vLLM's StructuredOutputRequest): its matcher, once compiled.

    `reasoning_ended` is the hook for reasoning models (vLLM's `reasoning_ended`): while False
    the request samples unconstrained and its tokens are not fed to the matcher;
    `reasoning_end_token_id`, when set, flips it once that token is generated (a reasoning
    parser in the frontend sets it, e.g. the id of `</think>`), and the grammar starts there.
    """

    __slots__ = ("params", "matcher", "reasoning_ended", "reasoning_end_token_id")

    def __init__(
        self, params: StructuredOutputsParams, reasoning_end_token_id: int | None = None
    ) -> None:
        self.params = params
        self.matcher: llguidance.LLMatcher | None = None
        self.reasoning_end_token_id = reasoning_end_token_id
        self.reasoning_ended = reasoning_end_token_id is None

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
        """Advance the matcher by one applied token; False when the grammar refused it (the
        mask did not hold: the request must fail)."""
        if not self.reasoning_ended:
            self.reasoning_ended = token_id == self.reasoning_end_token_id
            return True
        assert self.matcher is not None
        return self.matcher.consume_token(token_id)

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
        """The grammar is complete: nothing more may follow (the request finishes, STOP)."""
        return self.reasoning_ended and self.matcher is not None and self.matcher.is_stopped()


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
        self.num_words = (vocab_size + 31) // 32
        self._on_compiled = on_compiled
        self._pool: ThreadPoolExecutor | None = None
        self._fill_executor: llguidance.LLExecutor | None = None
        self._tokenizers: OrderedDict[bytes, Future[llguidance.LLTokenizer]] = OrderedDict()
        self._client_tokenizers: dict[int, bytes] = {}
        self._compiled: OrderedDict[tuple[object, ...], llguidance.LLMatcher] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._compiling: dict[int, _Compiling] = {}
        """req_handle -> its compile in progress."""
        self._bitmask = np.zeros((0, self.num_words), np.int32)
        num_used = vocab_size % 32  # of the last word's bits; the others are padding
        padding = (0xFFFFFFFF << num_used) & 0xFFFFFFFF if num_used else 0
        self._padding_bits = np.array([padding], np.uint32).view(np.int32)[0]
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
        if len(tokenizer_json) > MAX_TOKENIZER_JSON_CHARS:
            raise InvalidStructuredOutputs("the frontend's tokenizer is too large", "tokenizer")
        if any(not 0 <= e < self.vocab_size for e in eos):
            raise InvalidStructuredOutputs(
                "the frontend's eos_token_ids are outside the vocabulary", "tokenizer"
            )
        try:
            tokenizer = llguidance.LLTokenizer(
                tokenizer_json, n_vocab=self.vocab_size, eos_token=eos or None
            )
        except Exception as err:  # noqa: BLE001 (llguidance's parse errors are plain exceptions)
            raise InvalidStructuredOutputs(
                f"the frontend's tokenizer cannot be used for structured outputs: {err}",
                "tokenizer",
            ) from None
        logger.info("structured outputs: tokenizer of %d tokens ready", tokenizer.vocab_size)
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
            if template is not None:
                self._compiled.move_to_end(key)
                self.num_cache_hits += 1
        if template is None:
            template = self._compile_grammar(tokenizer, state.params)
            with self._cache_lock:
                self._compiled[key] = template
                while len(self._compiled) > self.config.max_cached_grammars:
                    self._compiled.popitem(last=False)
        matcher = template.deep_copy()
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
        """The packed masks of `states`, one row each in order (little-endian int32 words),
        filled by llguidance: one row after another below fill_parallel_threshold rows (as vLLM),
        in parallel from there on. With `drafts` (speculative decoding: each state's
        grammar-valid drafts), a state gets 1 + len(its drafts) rows: the mask of its next
        token, then the mask after each draft (llguidance consumes the drafts and rolls them
        back: the matcher keeps following applied tokens only); those are always filled by
        llguidance's parallel fill, which takes drafts."""
        num_rows = len(states) + sum(len(d) for d in drafts)
        if self._bitmask.shape[0] < num_rows:
            self._bitmask = np.zeros(
                (max(num_rows, 2 * self._bitmask.shape[0]), self.num_words), np.int32
            )
        bitmask = self._bitmask[:num_rows]
        if num_rows < self.config.fill_parallel_threshold and not any(drafts):
            # llguidance's fill_next_token_bitmask, minus its per-row numpy checks and slicing
            # (half the fill's time at batch 32): each matcher writes its row in place
            address, row_bytes = bitmask.ctypes.data, 4 * self.num_words
            for row, state in enumerate(states):
                matcher: llguidance.LLMatcher = state.matcher  # type: ignore[assignment]
                matcher.unsafe_compute_mask_ptr(address + row * row_bytes, row_bytes)
            return self._to_bytes(bitmask)
        if self._fill_executor is None:
            threads = self.config.num_fill_threads or None
            self._fill_executor = llguidance.LLExecutor(threads)
        if not drafts:
            matchers = [(state.matcher, row) for row, state in enumerate(states)]
            fill_next_token_bitmask_par(self._fill_executor, matchers, bitmask)  # type: ignore[arg-type]
            return self._to_bytes(bitmask)
        plain, with_drafts, row = [], [], 0
        for state, state_drafts in zip(states, drafts, strict=True):
            if state_drafts:  # llguidance refuses an empty draft list
                with_drafts.append((state.matcher, row, list(state_drafts)))
            else:
                plain.append((state.matcher, row))
            row += 1 + len(state_drafts)
        if with_drafts:
            fill_next_token_bitmask_par_with_draft_tokens(self._fill_executor, with_drafts, bitmask)  # type: ignore[arg-type]
        if plain:
            fill_next_token_bitmask_par(self._fill_executor, plain, bitmask)  # type: ignore[arg-type]
        return self._to_bytes(bitmask)

    def _to_bytes(self, bitmask: np.ndarray) -> bytes:
        """The rows' wire bytes, the last word's padding bits (past the vocabulary) set: a row
        that allows every token is then all -1 words, which the sparse wire form sends as
        nothing (core_svc/structured_bitmask.py) and the rank skips."""
        if self._padding_bits:
            bitmask[:, -1] |= self._padding_bits
        return bitmask.astype("<i4", copy=False).tobytes()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

"""For the structured-output tests: an engine core on a scripted rank that honours the step's
grammar bitmask (for a constrained request it samples a pseudo-random token its mask allows, and
fails the test on a mask that allows nothing), and grammars compiled by a manager alone."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence

import numpy as np

from core_svc.engine.engine_core import EngineCore
from core_svc.sched.scheduler_config import CacheConfig, SchedulerConfig
from core_svc.sched.scheduler_output import SchedulerOutput
from core_svc.structured_output.grammar_state import StructuredOutputRequest
from core_svc.structured_output.manager import StructuredOutputManager, StructuredOutputsConfig
from splitserve_contracts.output_types import ModelRunnerOutput
from splitserve_contracts.structured_outputs import StructuredOutputsParams
from tests.unit.core.fake_executor import ClientView, FakeExecutor, ShadowRequest


class MaskedExecutor(FakeExecutor):
    """A rank with a `vocab_size`-wide output that samples, for a constrained request, a
    pseudo-random token its mask allows."""

    def __init__(self, vocab_size: int, *args: object, **kwargs: object) -> None:
        super().__init__(*args, verify_context=False, **kwargs)  # type: ignore[arg-type]
        self.vocab_size = vocab_size
        self.ignores_mask: set[str] = set()
        """Request ids whose masks this rank ignores (a broken rank): they sample as scripted."""
        self._masks: dict[int, np.ndarray] = {}
        self.num_masked_steps = 0

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert not scheduler_output.has_pending_grammar, "ran before its masks came"
        grammar = scheduler_output.grammar_bitmask
        self._masks = {}
        if grammar is not None:
            self.num_masked_steps += 1
            words = np.frombuffer(grammar.bitmask, "<i4").reshape(len(grammar.req_handles), -1)
            assert words.shape[1] == (self.vocab_size + 31) // 32, "a mask of another width"
            for handle, row in zip(grammar.req_handles, words, strict=True):
                bits = np.unpackbits(row.view(np.uint8), bitorder="little")[: self.vocab_size]
                self._masks[handle] = np.flatnonzero(bits)
        return super().execute_model(scheduler_output)

    def sample(self, shadow: ShadowRequest) -> int:
        handle = next(h for h, s in self.reqs.items() if s is shadow)
        allowed = self._masks.get(handle)
        if allowed is None or shadow.request_id in self.ignores_mask:
            return super().sample(shadow)
        assert len(allowed), f"{shadow.request_id}: a mask that allows no token the model has"
        index = len(shadow.token_ids)
        digest = hashlib.sha256(f"{shadow.request_id}:{index}".encode()).digest()
        return int(allowed[int.from_bytes(digest[:4], "little") % len(allowed)])


def masked_engine(
    tokenizer_json: str,
    vocab_size: int,
    eos_token_ids: Sequence[int],
    async_scheduling: bool = False,
    timeout: float = 10.0,
) -> tuple[EngineCore, MaskedExecutor]:
    """An engine core for a model of `vocab_size` ids, client 1's tokenizer set."""
    scheduler_config = SchedulerConfig.of(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=256,
        vocab_size=vocab_size,
        async_scheduling=async_scheduling,
    )
    executor = MaskedExecutor(vocab_size, 4, 128, feeds_sampled=async_scheduling)
    engine = EngineCore(
        scheduler_config,
        CacheConfig.of(128, block_size=4),
        executor,
        structured_outputs_config=StructuredOutputsConfig(
            compile_timeout_s=timeout, num_compile_threads=1
        ),
    )
    engine.set_tokenizer(1, tokenizer_json, list(eos_token_ids))
    return engine, executor


def run_engine(engine: EngineCore, view: ClientView, seconds: float = 20.0) -> ClientView:
    """Step until nothing is left to do (compiles included)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if engine.has_work():
            view.absorb(engine.step())
        elif engine.structured.compiling:
            time.sleep(0.001)
        else:
            return view
    raise AssertionError("the engine is still busy")


def compiled_states(
    manager: StructuredOutputManager, params: Sequence[StructuredOutputsParams]
) -> list[StructuredOutputRequest]:
    """Grammar states of client 1's tokenizer, compiled in order (their matchers set)."""
    states = [StructuredOutputRequest(p) for p in params]
    for handle, state in enumerate(states):
        assert manager.submit(handle, 1, state, []) is None
    deadline = time.monotonic() + 20
    while manager.num_compiling and time.monotonic() < deadline:
        assert not manager.take_compiled(time.monotonic())[1]
        time.sleep(0.01)
    assert not manager.num_compiling, "a grammar still compiling after 20 s"
    return states

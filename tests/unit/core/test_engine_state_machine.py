"""Hypothesis state machine over the whole engine core with a tiny KV cache.

Random requests share prefixes, stop on EOS, run out of blocks (preemption), get aborted
singly or per client. Besides the invariants below, the FakeExecutor checks every step
that each scheduled request's attention context holds exactly its own tokens.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from core_svc.engine.engine_core import EngineCore
from core_svc.request import Request
from tests.unit.core.fake_executor import (
    ClientView,
    FakeExecutor,
    make_engine,
    make_request,
    run_to_completion,
)

EOS = 2
BLOCK_SIZE = 4
PREFIXES = [list(range(10, 22)), [10, 11, 12, 13, 30, 31, 32, 33], list(range(40, 50))]
tokens_st = st.lists(st.sampled_from([EOS, 5, 6, 7, 8]), max_size=6)


class EngineMachine(RuleBasedStateMachine):
    engine: EngineCore
    executor: FakeExecutor

    def __init__(self) -> None:
        super().__init__()
        self.view = ClientView()
        self.added: list[Request] = []
        self.next_handle = 0

    @initialize(
        policy=st.sampled_from(["fcfs", "priority"]),
        caching=st.booleans(),
        async_scheduling=st.booleans(),
        adaptive_prefill_chunk=st.sampled_from([0, 3]),
    )
    def create(
        self, policy: str, caching: bool, async_scheduling: bool, adaptive_prefill_chunk: int
    ) -> None:
        self.engine, self.executor = make_engine(
            num_blocks=12, block_size=BLOCK_SIZE, max_num_seqs=4, max_num_batched_tokens=16,
            max_model_len=32, policy=policy, enable_prefix_caching=caching or policy == "fcfs",
            async_scheduling=async_scheduling, adaptive_prefill_chunk=adaptive_prefill_chunk,
        )  # fmt: skip

    @rule(
        specs=st.lists(
            st.tuples(
                st.sampled_from(range(len(PREFIXES))),  # shared prefix
                st.integers(0, 12),  # its length
                tokens_st,  # own suffix
                tokens_st,  # scripted outputs (then pseudo-random)
                st.integers(1, 10),  # max_tokens
                st.integers(0, 2),  # min_tokens
                st.sampled_from([1, 2]),  # client_id
                st.sampled_from(["", "", "s"]),  # cache salt
                st.integers(-1, 1),  # priority
            ),
            min_size=1,
            max_size=4,
        )
    )
    def add(
        self, specs: list[tuple[int, int, list[int], list[int], int, int, int, str, int]]
    ) -> None:
        for (
            prefix,
            prefix_len,
            suffix,
            script,
            max_tokens,
            min_tokens,
            client_id,
            salt,
            priority,
        ) in specs:
            prompt = PREFIXES[prefix][:prefix_len] + suffix or [1]
            self.next_handle += 1
            request = make_request(
                self.next_handle, prompt, client_id=client_id, eos_token_id=EOS,
                cache_salt=salt, priority=priority, max_tokens=max_tokens, min_tokens=min_tokens,
            )  # fmt: skip
            self.executor.scripts[request.request_id] = script
            self.engine.add_request(request)
            self.added.append(request)

    @rule(num_steps=st.integers(1, 4))
    def step(self, num_steps: int) -> None:
        for _ in range(num_steps):
            self.view.absorb(self.engine.step())

    @precondition(lambda self: self.engine.client_requests)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        live = [(c, h) for c, reqs in self.engine.client_requests.items() for h in reqs]
        client_id, handle = data.draw(st.sampled_from(live))
        self.engine.abort_requests(client_id, [handle, handle + 1000])

    @rule(client_id=st.sampled_from([1, 2]))
    def abort_client(self, client_id: int) -> None:
        self.engine.abort_client(client_id)

    @rule(
        prefix=st.sampled_from(range(len(PREFIXES))),
        extra=tokens_st,
        salt=st.sampled_from(["", "s"]),
    )
    def probe_prefix_cache(self, prefix: int, extra: list[int], salt: str) -> None:
        """A prefix hit returns only blocks whose KV holds exactly the probe's tokens."""
        probe = make_request(0, PREFIXES[prefix] + extra, cache_salt=salt)
        self.engine.scheduler.block_hasher.extend(probe.block_hashes, probe.all_token_ids, salt)
        blocks, num_hits = self.engine.kv_cache_manager.get_computed_blocks(probe)
        assert num_hits < probe.num_tokens
        for i, block in enumerate(blocks):
            for slot in range(BLOCK_SIZE):
                pos = i * BLOCK_SIZE + slot
                assert self.executor.kv[block.block_id][slot] == (pos, probe.all_token_ids[pos])
        assert num_hits == 0 or any(
            r.cache_salt == salt and r.all_token_ids[:num_hits] == probe.all_token_ids[:num_hits]
            for r in self.added
        )

    @invariant()
    def blocks_are_accounted_for(self) -> None:
        if not hasattr(self, "engine"):
            return
        kv = self.engine.kv_cache_manager
        pool = kv.block_pool
        holders = Counter(b.block_id for blocks in kv.req_to_blocks.values() for b in blocks)
        assert pool.get_num_free_blocks() + len(holders) == pool.num_usable_blocks
        for block in pool.blocks[1:]:
            assert block.ref_cnt == holders[block.block_id] >= 0
        scheduler = self.engine.scheduler
        assert {r.req_handle for r in scheduler.running} == set(kv.req_to_blocks)
        assert len(scheduler.running) + len(scheduler.waiting) == len(scheduler.requests)
        assert all(not r.is_finished for r in scheduler.requests.values())
        if not scheduler.requests:
            assert pool.get_usage() == 0.0

    @invariant()
    def outputs_are_consistent(self) -> None:
        for key, tokens in self.view.tokens.items():
            request = next(r for r in self.added if (r.client_id, r.client_handle) == key)
            assert tokens == request.output_token_ids
            assert len(tokens) <= request.max_tokens

    def teardown(self) -> None:
        if not hasattr(self, "engine"):
            return
        run_to_completion(self.engine, self.view, max_steps=2000)
        stats = self.engine.make_stats()
        assert (stats.num_used_blocks, stats.kv_cache_usage) == (0, 0.0)
        assert self.engine.client_requests == {}
        assert self.executor.reqs == {}, "workers were told to drop every request"


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)

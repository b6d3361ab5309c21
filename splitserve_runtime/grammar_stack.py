"""Threads with stacks deep enough for llguidance's grammar compiler.

llguidance compiles a grammar by recursion, one native call per level: a chained rule or
terminal, a nested group, a JSON Schema `$ref`. When a grammar is deeper than the thread's
stack, the process gets SIGSEGV, and nothing can catch that: one request kills the frontend or
the core. On a default 8 MiB thread (llguidance 1.9.1) that happens at about 2,650 chained Lark
rules (40 KB of grammar), 155 rules that each nest 28 groups (the most its Lark parser takes),
3,500 chained terminals or 870 `$ref`s through `properties`. The stack each level needs is
constant, so the deepest grammar that fits MAX_SPEC_CHARS (256 KiB) needs at most:

| shape (densest spelling)                  | stack per level | levels in 256 KiB | stack   |
|-------------------------------------------|-----------------|-------------------|---------|
| chained rules, each in 28 nested groups   | 54 KiB          | 4,119             | 218 MiB |
| chained rules (`ab:ac`)                   | 3.2 KiB         | 30,014            | 94 MiB  |
| chained terminals (`AB:AC`)               | 2.3 KiB         | 30,014            | 70 MiB  |
| `$ref`s chained through `properties`      | 9.4 KiB         | 5,084             | 48 MiB  |

That is at most 870 bytes of stack per character of grammar. Grammar threads get
GRAMMAR_STACK_BYTES, 2 KiB per character of the longest grammar the contracts admit (512 MiB):
every grammar that fits compiles with more than twice the stack it needs
(tests/reliability/test_grammar_depth.py compiles each shape at its largest), and a longer one
is refused by name before it gets here. Other nestings are bounded before they recurse: JSON
nests at most 128 levels in llguidance's JSON parser (deeper than Python's recursion limit it
is refused by the contracts), a regex 250 groups, a Lark rule 28 groups.

Each call gets a thread of its own, which ends with the call: its stack is address space,
reserved when it starts, backed by memory only as deep as its grammar went, and handed back
when it ends (a pool's threads would keep the deepest grammar's pages, up to 220 MiB each).
Starting one costs a few hundred microseconds at most. Matching (masks, consuming tokens,
copies) does not recurse by depth (the table's grammars matched on 512 KiB threads), so only
compiling needs these threads.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from splitserve_contracts.structured_outputs import MAX_SPEC_CHARS

T = TypeVar("T")

STACK_BYTES_PER_GRAMMAR_CHAR = 2048
"""Stack given per character of grammar: the most measured (870 bytes), more than doubled."""
GRAMMAR_STACK_BYTES = MAX_SPEC_CHARS * STACK_BYTES_PER_GRAMMAR_CHAR
"""The stack of every thread that compiles grammars (512 MiB)."""

_stack_size_lock = threading.Lock()


def on_grammar_stack(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on a new thread of GRAMMAR_STACK_BYTES of stack; waits for it and returns what
    it returned, or raises what it raised.

    threading.stack_size is the process's setting for the threads started next: it is set
    around this thread's start and restored (a thread that another part of the process starts
    meanwhile gets the large stack too, which costs it address space only)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn(*args)
        except BaseException as err:  # noqa: BLE001 (re-raised on the caller's thread)
            outcome["error"] = err

    thread = threading.Thread(target=run, name="grammar", daemon=True)
    with _stack_size_lock:
        previous = threading.stack_size(GRAMMAR_STACK_BYTES)
        try:
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


class GrammarThreadPool(ThreadPoolExecutor):
    """A ThreadPoolExecutor (its queue, its bound on calls at once) whose every call runs on a
    grammar thread of its own (on_grammar_stack)."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        return super().submit(on_grammar_stack, functools.partial(fn, *args, **kwargs))

"""Grammar threads (splitserve_runtime/grammar_stack.py): each call runs on a thread of its own
with GRAMMAR_STACK_BYTES of stack, returns or raises on the caller's thread, and leaves the
process's stack size for other threads as it was. (That the stack holds the deepest grammars
is tests/reliability/test_grammar_depth.py's.)"""

from __future__ import annotations

import ctypes
import sys
import threading

import pytest

from splitserve_contracts.structured_outputs import MAX_SPEC_CHARS
from splitserve_runtime.grammar_stack import (
    GRAMMAR_STACK_BYTES,
    GrammarThreadPool,
    on_grammar_stack,
)


def _stack_bytes() -> int:
    """The calling thread's stack size, as glibc gave it."""
    libc = ctypes.CDLL(None)
    libc.pthread_self.restype = ctypes.c_ulong
    attr = ctypes.create_string_buffer(256)  # a pthread_attr_t (56 bytes on x86-64)
    assert libc.pthread_getattr_np(ctypes.c_ulong(libc.pthread_self()), attr) == 0
    size = ctypes.c_size_t()
    assert libc.pthread_attr_getstacksize(attr, ctypes.byref(size)) == 0
    libc.pthread_attr_destroy(attr)
    return size.value


def _where() -> tuple[str, int, bool]:
    return threading.current_thread().name, _stack_bytes(), threading.current_thread().daemon


def test_the_stack_is_twice_the_most_measured_per_character_of_the_longest_grammar() -> None:
    assert GRAMMAR_STACK_BYTES == 512 * 1024 * 1024
    assert GRAMMAR_STACK_BYTES >= 2 * 870 * MAX_SPEC_CHARS


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads glibc's thread attributes")
def test_calls_run_on_threads_of_their_own_with_the_grammar_stack() -> None:
    name, stack, _ = on_grammar_stack(_where)
    assert name == "grammar" and stack >= GRAMMAR_STACK_BYTES
    with GrammarThreadPool(2, "grammar-compile") as pool:
        futures = [pool.submit(_where) for _ in range(4)]
        assert {f.result()[:2] for f in futures} == {("grammar", stack)}
    sizes: list[int] = []
    outside = threading.Thread(target=lambda: sizes.append(_stack_bytes()))
    outside.start()
    outside.join()
    assert sizes[0] < GRAMMAR_STACK_BYTES  # other threads keep the process's setting
    assert threading.stack_size() == 0


def test_results_and_errors_come_back_to_the_caller() -> None:
    assert on_grammar_stack(int, "42") == 42
    with pytest.raises(ValueError, match="invalid literal"):
        on_grammar_stack(int, "forty-two")
    with GrammarThreadPool(1, "grammar-compile") as pool:
        assert pool.submit(int, "101", base=2).result() == 5
        assert isinstance(pool.submit(int, "x").exception(), ValueError)

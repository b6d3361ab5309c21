"""Run as `python -m tests.reliability.grammar_depth_probe TOKENIZER_JSON`: every case of
CASES through the frontend's check (check_grammar, called on this process's main thread) and
the core's compile (StructuredOutputManager, with the tokenizer), printing one line per case,
`label<TAB>check result<TAB>compile result`, as soon as both ran. A grammar deeper than the
thread's stack kills this process (SIGSEGV) on the case after the last line printed."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import llguidance

from core_svc.structured_output.manager import (
    StructuredOutputManager,
    StructuredOutputRequest,
    StructuredOutputsConfig,
)
from splitserve_contracts.structured_outputs import (
    InvalidStructuredOutputs,
    StructuredOutputsParams,
    validate,
)
from splitserve_runtime.grammars import check_grammar
from tests.reliability.grammar_shapes import (
    DEEPEST,
    MAX_LARK_GROUPS,
    Shape,
    gbnf_chain,
    largest,
    nested_json,
    nested_regex,
    nested_schema,
    ref_chain,
    rule_chain,
    tagged,
)

DEPTHS = (1, 10, 100, 1_000, 3_000, 10_000)


def cases() -> Iterator[tuple[str, Shape]]:
    """Depth by width by shape, then the deepest of each shape that fits MAX_SPEC_CHARS."""
    for depth in DEPTHS:
        for width in (1, 8):
            yield f"rules d={depth} w={width}", rule_chain(depth, width)
            yield f"terminals d={depth} w={width}", rule_chain(depth, width, terminals=True)
        for groups in (1, 5, MAX_LARK_GROUPS, MAX_LARK_GROUPS + 1):
            if depth * groups <= 60_000:
                yield f"rules d={depth} groups={groups}", rule_chain(depth, groups=groups)
        if depth <= 3_000:
            for via in ("properties", "items", "anyOf"):
                yield f"$refs via {via} d={depth}", ref_chain(depth, via)
            yield f"$refs via properties d={depth} w=8", ref_chain(depth, "properties", 8)
        for via in ("items", "properties"):
            yield f"nested json via {via} d={depth}", nested_json(depth, via)
        yield f"tagged nested json d={depth}", tagged(nested_schema(depth))
        yield f"nested regex d={depth} w=4", nested_regex(depth, 4)
        if depth <= 100:  # llguidance converts GBNF in Python, in time quadratic in its size
            yield f"gbnf rules d={depth}", gbnf_chain(depth)
    yield "nested json d=5000", nested_json(5_000)
    for label, build in DEEPEST.items():
        yield f"largest: {label}", largest(build)


def check(params: StructuredOutputsParams) -> str:
    try:
        validate(params)
        check_grammar(params)
    except InvalidStructuredOutputs as err:
        return f"refused: {err.describe()}"
    return "ok"


def compile_in_core(
    manager: StructuredOutputManager, handle: int, params: StructuredOutputsParams
) -> str:
    """What the core does with a request's constraint: the checks on its bounds (as
    core_svc/engine/request_checks.py), then the compile on its compile pool."""
    try:
        validate(params)
    except InvalidStructuredOutputs as err:
        return f"refused: {err.describe()}"
    manager.submit(handle, 1, StructuredOutputRequest(params), [])
    while True:
        ready, failed = manager.take_compiled(time.monotonic())
        if handle in ready:
            return "ok"
        if failed:
            return f"refused: {failed[0][1]}"
        time.sleep(0.005)


def main(tokenizer_path: str) -> None:
    tokenizer_json = Path(tokenizer_path).read_text()
    vocab_size = llguidance.LLTokenizer(tokenizer_json).vocab_size
    config = StructuredOutputsConfig(compile_timeout_s=600.0)
    manager = StructuredOutputManager(vocab_size, config)
    manager.set_tokenizer(1, tokenizer_json, [0])
    for handle, (label, (field, text)) in enumerate(cases()):
        params = StructuredOutputsParams(**{field: text})
        checked = check(params)
        compiled = compile_in_core(manager, handle, params)
        print(f"{label}\t{checked}\t{compiled}", flush=True)
    manager.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])

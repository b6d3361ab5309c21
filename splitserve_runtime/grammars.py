"""Structured-outputs constraints as llguidance grammars (vLLM's `guidance` backend).

The frontend calls `check_grammar` to refuse a bad constraint before it reaches the engine
(no tokenizer needed); the engine core compiles `to_llguidance` with its stream's tokenizer.
Both compile on threads whose stack the deepest grammar fits (splitserve_runtime.grammar_stack:
llguidance's compiler recurses by the grammar's depth, and overflowing a thread's stack kills
the process). Both read the same translation, after vLLM's `serialize_guidance_grammar`:

- json: the schema through llguidance's JSON Schema compiler; `disable_additional_properties`
  closes every object that has no `additionalProperties` keyword.
- json_object: the schema `{"type": "object"}`.
- regex, choice, grammar (Lark, or GBNF/EBNF converted by llguidance), structural_tag (vLLM's
  triggers and structures, as llguidance StructTags).

Whitespace in JSON is bounded by default: where JSON allows whitespace the grammar allows at
most one line break followed by up to 20 blanks or tabs, or one blank (`BOUNDED_WHITESPACE`).
Unbounded whitespace (llguidance's and xgrammar's "any whitespace") lets a weak model spend
hundreds of tokens on blanks before the JSON closes. `disable_any_whitespace` allows none
(compact JSON, vLLM's meaning); `whitespace_pattern` sets the pattern.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import llguidance

from splitserve_contracts.structured_outputs import (
    InvalidStructuredOutputs,
    StructuredOutputsParams,
)
from splitserve_runtime.grammar_stack import on_grammar_stack

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

BOUNDED_WHITESPACE = r"(?:\n[ \t]{0,20}| )?"
"""Where JSON allows whitespace, by default: nothing, one blank, or a line break and an
indentation of up to 20 blanks or tabs."""
MAX_SCHEMA_DEPTH = 64
"""Deepest nesting of a JSON Schema walked for `disable_additional_properties`."""


def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's resource limits (fuel per step, lexer states, grammar size) at their
    defaults, with errors that do not echo the grammar (clients' schemas stay out of logs)."""
    return llguidance.LLParserLimits(verbose_errors=False)


def to_llguidance(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a validated constraint; InvalidStructuredOutputs when the
    constraint cannot be turned into one (a malformed structural tag, an unconvertible GBNF
    grammar)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        try:
            schema = json.loads(params.spec)
            if params.disable_additional_properties:
                schema = _close_objects(schema, 0)
            return llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults=_json_options(params)
            )
        except InvalidStructuredOutputs:
            raise
        except RecursionError:
            raise InvalidStructuredOutputs("nests too deeply to be read", kind) from None
        except ValueError as err:  # e.g. a number llguidance cannot take
            raise InvalidStructuredOutputs(f"is not supported: {err}", kind) from None
    if kind == "structural_tag":
        return _structural_tag(params.spec)
    fmt = {"regex": "regex", "choice": "choice", "grammar": "grammar"}[kind]
    try:
        return llguidance.grammar_from(fmt, params.spec)  # type: ignore[arg-type]
    except ValueError as err:
        raise InvalidStructuredOutputs(str(err), kind) from None


def check_grammar(params: StructuredOutputsParams) -> None:
    """Refuse a constraint llguidance cannot compile (InvalidStructuredOutputs naming the
    field and llguidance's reason); checked without a tokenizer, so cheap, on a grammar thread
    (the caller waits)."""
    on_grammar_stack(_check_grammar, params)


def _check_grammar(params: StructuredOutputsParams) -> None:
    grammar = to_llguidance(params)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, None, limits=parser_limits()
    )
    if is_error:
        raise InvalidStructuredOutputs(f"is not supported: {summary(messages)}", params.kind)


def summary(messages: list[str]) -> str:
    """llguidance's error in one line: its first line and its `error:` lines (the source
    excerpt between them is left out), at most 500 characters, its categories lower-cased."""
    lines = [line.strip() for line in (messages[0] if messages else "").splitlines()]
    kept = [line for i, line in enumerate(lines) if line and (i == 0 or line.startswith("error:"))]
    text = " ".join(kept)[:500] or "invalid grammar"
    # Its matchers' categories ("Parser Error: ...") read as a leaked Python exception.
    return re.sub(r"\b(\w+) Error: ", lambda m: f"{m.group(1).lower()} error: ", text)


def _json_options(params: StructuredOutputsParams) -> JsonCompileOptions:
    if params.disable_any_whitespace:
        return {"whitespace_flexible": False}
    pattern = params.whitespace_pattern or BOUNDED_WHITESPACE
    return {"whitespace_flexible": True, "whitespace_pattern": pattern}


def _close_objects(schema: Any, depth: int) -> Any:
    """vLLM's process_for_additional_properties: every object schema without an
    `additionalProperties` keyword gets `additionalProperties: false`."""
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidStructuredOutputs(f"nests deeper than {MAX_SCHEMA_DEPTH} levels", "json")
    if isinstance(schema, list):
        return [_close_objects(item, depth + 1) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _close_objects(value, depth + 1) for key, value in schema.items()}
    if closed.get("type") == "object" or "properties" in closed:
        closed.setdefault("additionalProperties", False)
    return closed


def _structural_tag(spec: str) -> str:
    """vLLM's structural tag ({"structures": [{"begin", "schema", "end"}], "triggers": [...]})
    as llguidance StructTags: free text until a trigger, then the tagged structure."""
    tag = json.loads(spec)
    triggers = tag.get("triggers")
    structures = tag.get("structures")
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise InvalidStructuredOutputs("needs `triggers`, a list of strings", "structural_tag")
    if not isinstance(structures, list) or not structures:
        raise InvalidStructuredOutputs("needs `structures`, a non-empty list", "structural_tag")
    tags = []
    for structure in structures:
        if not isinstance(structure, dict) or not all(
            isinstance(structure.get(k), str) for k in ("begin", "end")
        ):
            raise InvalidStructuredOutputs(
                "each structure needs `begin` and `end` strings and a `schema`", "structural_tag"
            )
        begin = structure["begin"]
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise InvalidStructuredOutputs(
                f"no trigger starts the structure begin {begin!r}", "structural_tag"
            )
        schema = structure.get("schema", {})
        if not isinstance(schema, dict):
            raise InvalidStructuredOutputs(
                "a structure's `schema` must be an object", "structural_tag"
            )
        tags.append(
            llguidance.StructTag(trigger=trigger, begin=begin, grammar=schema, end=structure["end"])
        )
    return llguidance.StructTag.to_grammar(tags)

"""Constraints of every kind llguidance compiles, built to a depth and a width: the shapes whose
compile recurses deepest per character (splitserve_runtime/grammar_stack.py's table), and the
nestings its parsers bound. `largest` finds the deepest one that still fits MAX_SPEC_CHARS.

A shape is (field, text): the structured-outputs field ("grammar", "json", "regex",
"structural_tag") and its text, as a client sends it."""

from __future__ import annotations

import json
from collections.abc import Callable

from splitserve_contracts.structured_outputs import MAX_SPEC_CHARS

Shape = tuple[str, str]
MAX_LARK_GROUPS = 28
"""The most groups llguidance's Lark parser nests in one rule (29: "too deeply nested")."""


def name(i: int, upper: bool = False) -> str:
    """The i-th shortest rule name: a, b, ..., z, aa, ab, ... (terminals: upper case)."""
    text = ""
    i += 1
    while i:
        i, rest = divmod(i - 1, 26)
        text = chr(97 + rest) + text
    return text.upper() if upper else text


def rule_chain(depth: int, width: int = 1, groups: int = 0, terminals: bool = False) -> Shape:
    """A Lark grammar of `depth` chained rules (or terminals), each a choice of `width`
    literals and the next one, inside `groups` nested groups: `a:(("x"|b))`."""
    literals = "|".join(json.dumps(name(j)) for j in range(width - 1))
    links = []
    for i in range(depth - 1):
        body = f"{literals}|{name(i + 1, terminals)}" if literals else name(i + 1, terminals)
        links.append(f"{name(i, terminals)}:{'(' * groups}{body}{')' * groups}\n")
    end = f'{name(depth - 1, terminals)}:"a"\n'
    return "grammar", f"start: {name(0, terminals)}\n" + "".join(links) + end


def gbnf_chain(depth: int) -> Shape:
    """A GBNF grammar of `depth` chained rules (llguidance converts it to Lark)."""
    links = "".join(f'{name(i)} ::= "a" {name(i + 1)}\n' for i in range(depth - 1))
    return "grammar", f'root ::= {name(0)}\n{links}{name(depth - 1)} ::= "a"\n'


def ref_chain(depth: int, via: str = "properties", width: int = 1) -> Shape:
    """A JSON Schema of `depth` `$defs` chained by `$ref`, through `properties` (`width` of
    them per object), `items` or `anyOf`."""

    def link(i: int) -> str:
        ref = f'{{"$ref":"#/$defs/{i + 1}"}}'
        if via == "items":
            return f'{{"items":{ref}}}'
        if via == "anyOf":
            return f'{{"anyOf":[{{"type":"null"}},{ref}]}}'
        others = "".join(f',"{name(j)}":{{}}' for j in range(1, width))
        return f'{{"properties":{{"a":{ref}{others}}}}}'

    defs = "".join(f'"{i}":{link(i)},' for i in range(depth - 1))
    return "json", f'{{"$ref":"#/$defs/0","$defs":{{{defs}"{depth - 1}":{{}}}}}}'


def nested_schema(depth: int, via: str = "items") -> str:
    """A JSON Schema nested `depth` levels in place: arrays of arrays, or objects of objects."""
    if via == "items":
        return '{"type":"array","items":' * depth + '{"type":"integer"}' + "}" * depth
    return '{"type":"object","properties":{"a":' * depth + '{"type":"integer"}' + "}}" * depth


def nested_json(depth: int, via: str = "items") -> Shape:
    return "json", nested_schema(depth, via)


def nested_regex(depth: int, width: int = 1) -> Shape:
    alternatives = "|".join(name(j) for j in range(width))
    return "regex", "(" * depth + alternatives + ")" * depth


def tagged(schema: str) -> Shape:
    """A structural tag whose one structure holds `schema`."""
    structure = f'{{"begin":"<f>","end":"</f>","schema":{schema}}}'
    return "structural_tag", f'{{"triggers":["<f"],"structures":[{structure}]}}'


def largest(build: Callable[[int], Shape]) -> Shape:
    """build(depth) at the largest depth whose text fits MAX_SPEC_CHARS."""
    low, high = 1, MAX_SPEC_CHARS
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if len(build(middle)[1]) <= MAX_SPEC_CHARS else (low, middle)
    return build(low)


DEEPEST: dict[str, Callable[[int], Shape]] = {
    "rules in 28 groups each": lambda d: rule_chain(d, groups=MAX_LARK_GROUPS),
    "terminals in 28 groups each": lambda d: rule_chain(d, groups=MAX_LARK_GROUPS, terminals=True),
    "chained rules": rule_chain,
    "chained terminals": lambda d: rule_chain(d, terminals=True),
    "$refs through properties": ref_chain,
    "$refs through items": lambda d: ref_chain(d, "items"),
    "$refs through anyOf": lambda d: ref_chain(d, "anyOf"),
    "a structural tag of $refs": lambda d: tagged(ref_chain(d)[1]),
}
"""The table's shapes (and their kin), each built at its largest by `largest`: every one
compiles on a grammar thread, where it overflowed a default 8 MiB thread."""

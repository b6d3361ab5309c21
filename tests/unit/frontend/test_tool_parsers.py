"""Property tests of the tool-call parsers: generated calls, rendered in each model family's
format, parse back to the same names and arguments; streamed in any chunking, the deltas add up
to the non-streaming answer (the parsers' prefix promise, base.py); text without calls stays
content; malformed calls fall back to content as vLLM's parsers do."""

from __future__ import annotations

import json
import keyword
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from frontend_svc.openai.tool_parsers import TOOL_PARSERS, ToolParser
from frontend_svc.openai.tool_parsers.forced import NamedToolParser, RequiredToolParser
from frontend_svc.openai.tool_parsers.stream import ToolCallStream

Call = tuple[str, dict[str, Any]]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MARKERS = (
    "<tool_call>",
    "</tool_call>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "<|python",
    "<parameter",
    "<function",
)

names = st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True)
texts = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20).filter(
    lambda s: not any(m in s for m in MARKERS) and s.strip().lower() != "null"
)
scalars = st.one_of(
    texts,
    st.integers(-(10**12), 10**12),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.booleans(),
    st.none(),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=6,
)
arguments = st.dictionaries(names, values, max_size=4)
calls = st.lists(st.tuples(names, arguments), min_size=1, max_size=3)
contents = texts.filter(lambda s: not s.lstrip().startswith(("{", "[", "<")))


def hermes(content: str, items: list[Call]) -> str:
    body = "".join(
        f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>\n" for n, a in items
    )
    return content + body


def llama3_json(content: str, items: list[Call]) -> str:
    return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in items)


def mistral_list(content: str, items: list[Call]) -> str:
    listed = [{"name": n, "arguments": a} for n, a in items]
    return f"{content}[TOOL_CALLS] {json.dumps(listed, ensure_ascii=False)}"


def mistral_v11(content: str, items: list[Call]) -> str:
    return content + "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in items)


def pythonic(content: str, items: list[Call]) -> str:
    rendered = [f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in items]
    return f"[{', '.join(rendered)}]"


def _xml_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def qwen3_xml(content: str, items: list[Call]) -> str:
    out = content
    for name, args in items:
        params = "".join(
            f"<parameter={k}>\n{_xml_value(v)}\n</parameter>\n" for k, v in args.items()
        )
        out += f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"
    return out


def _json_type(value: Any) -> str:
    kinds = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array"}
    return kinds.get(type(value), "object")


def schemas(items: list[Call]) -> dict[str, Any]:
    """Each tool's parameters typed by the generated values (qwen3_xml converts by type)."""
    return {
        n: {"type": "object", "properties": {k: {"type": _json_type(v)} for k, v in a.items()}}
        for n, a in items
    }


FORMATS: dict[str, tuple[Callable[[str, list[Call]], str], bool]] = {
    "hermes": (hermes, True),
    "llama3_json": (llama3_json, False),
    "mistral": (mistral_list, True),
    "mistral_v11": (mistral_v11, True),
    "pythonic": (pythonic, False),
    "qwen3_xml": (qwen3_xml, True),
}
"""Format -> (renderer, whether content may come before the calls)."""


def _parser(fmt: str, items: list[Call]) -> ToolParser:
    name = "mistral" if fmt.startswith("mistral") else fmt
    if fmt == "qwen3_xml":  # one schema per name (the last call of a name wins)
        return TOOL_PARSERS[name](schemas(items))
    return TOOL_PARSERS[name]()


def _distinct_types(items: list[Call]) -> list[Call]:
    """qwen3_xml converts by the schema: a name used twice keeps its first call's types."""
    seen: dict[str, dict[str, Any]] = {}
    return [(n, a) for n, a in items if seen.setdefault(n, a) is a]


def _streamed(
    parser: ToolParser, text: str, cuts: list[int]
) -> tuple[str, list[tuple[str, str, str]]]:
    stream = ToolCallStream(parser)
    content = ""
    found: dict[int, list[str]] = {}
    done = 0
    for end in [*sorted(set(cuts)), len(text)]:
        piece, deltas = stream.update(text[done:end], is_final=end == len(text))
        done = end
        content += piece
        for delta in deltas:
            entry = found.setdefault(delta["index"], ["", "", ""])
            if "id" in delta:
                assert not entry[0], "a call's header came twice"
                entry[0], entry[1] = delta["id"], delta["function"]["name"]
            entry[2] += delta["function"]["arguments"]
    return content, [tuple(found[i]) for i in sorted(found)]  # type: ignore[misc]


@pytest.mark.parametrize("fmt", list(FORMATS))
@SETTINGS
@given(data=st.data())
def test_rendered_calls_parse_back_whole_and_streamed(fmt: str, data: st.DataObject) -> None:
    render, has_content = FORMATS[fmt]
    items = data.draw(calls)
    if fmt == "qwen3_xml":
        items = _distinct_types(items)
    if fmt == "pythonic":  # Python calls: names and keywords are identifiers, not keywords
        items = [
            (n, {k: v for k, v in a.items() if not keyword.iskeyword(k)})
            for n, a in items
            if not keyword.iskeyword(n)
        ]
        assume(items)
    content = data.draw(contents) if has_content else ""
    text = render(content, items)
    parser = _parser(fmt, items)
    got_content, drafts = parser.extract(text)
    assert got_content == content
    assert [(d.name, json.loads(d.arguments)) for d in drafts] == [(n, a) for n, a in items]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    streamed_content, streamed = _streamed(_parser(fmt, items), text, cuts)
    assert streamed_content == content
    assert [(name, args) for _, name, args in streamed] == [(d.name, d.arguments) for d in drafts]
    char_by_char = _streamed(_parser(fmt, items), text, list(range(len(text))))
    assert char_by_char[1] and [c[1:] for c in char_by_char[1]] == [c[1:] for c in streamed]


@pytest.mark.parametrize("fmt", list(FORMATS))
@SETTINGS
@given(text=texts)
def test_text_without_calls_is_content(fmt: str, text: str) -> None:
    if fmt in ("llama3_json", "pythonic") and text.lstrip().startswith(("{", "[", "<")):
        return
    parser = _parser(fmt, [])
    assert parser.extract(text) == (text, [])
    assert _streamed(_parser(fmt, []), text, list(range(len(text)))) == (text, [])


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("hermes", 'hi <tool_call>\n{"name": "f", "arguments": {"a": 1}'),  # unfinished
        ("hermes", "<tool_call>\nnot json\n</tool_call>"),
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
        ("llama3_json", '{"name": "f", "parameters": [1, 2]}'),  # arguments not an object
        ("pythonic", "[f(1, 2)]"),  # positional arguments
        ("pythonic", "[f(a=open('x'))]"),  # not a literal
        ("mistral", "[TOOL_CALLS]f[ARGS]{bad"),
    ],
)
def test_malformed_calls_fall_back_to_content(fmt: str, text: str) -> None:
    assert TOOL_PARSERS[fmt]().extract(text) == (text, [])


def test_qwen3_xml_converts_parameters_by_their_schema_type() -> None:
    tools = {
        "f": {
            "type": "object",
            "properties": {
                "n": {"type": "integer"},
                "x": {"type": "number"},
                "ok": {"type": "boolean"},
                "tags": {"type": "array"},
                "s": {"type": "string"},
                "opt": {"type": ["string", "null"]},
            },
        }
    }
    text = (
        "<tool_call>\n<function=f>\n<parameter=n>\n42\n</parameter>\n<parameter=x>\n2.5\n"
        "</parameter>\n<parameter=ok>\nTrue\n</parameter>\n<parameter=tags>\n['a', 'b']\n"
        "</parameter>\n<parameter=s>\n007\n</parameter>\n<parameter=opt>\nnull\n</parameter>\n"
        '<parameter=extra>\n{"k": 1}\n</parameter>\n</function>\n</tool_call>'
    )
    _, drafts = TOOL_PARSERS["qwen3_xml"](tools).extract(text)
    assert json.loads(drafts[0].arguments) == {
        "n": 42, "x": 2.5, "ok": True, "tags": ["a", "b"], "s": "007", "opt": None,
        "extra": '{"k": 1}',
    }  # fmt: skip


@SETTINGS
@given(items=calls, data=st.data())
def test_forced_forms_parse_in_any_chunking(items: list[Call], data: st.DataObject) -> None:
    text = json.dumps(
        [{"name": n, "parameters": a} for n, a in items],
        indent=data.draw(st.sampled_from([None, 2])),
    )
    content, drafts = RequiredToolParser().extract(text)
    assert content == "" and [(d.name, json.loads(d.arguments)) for d in drafts] == items
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    assert [c[1:] for c in _streamed(RequiredToolParser(), text, cuts)[1]] == [
        (d.name, d.arguments) for d in drafts
    ]
    args = json.dumps(items[0][1])
    named = _streamed(NamedToolParser("pick"), args, cuts)
    assert named[1] == [(named[1][0][0], "pick", args)]


def test_mistral_ids_are_nine_letters_or_digits() -> None:
    stream = ToolCallStream(TOOL_PARSERS["mistral"]())
    _, deltas = stream.update('[TOOL_CALLS]f[ARGS]{"a": 1}', is_final=True)
    assert len(deltas[0]["id"]) == 9 and deltas[0]["id"].isalnum()
